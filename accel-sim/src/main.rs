//! `sluice-accel`: one simulated accelerator (see the library documentation and
//! docs/token-lab.md).

use std::{net::SocketAddr, process::ExitCode};

use clap::Parser;
use sluice_accel::{
    model::Params,
    server::{self, Config},
};

/// A simulated LLM accelerator: OpenAI-compatible streaming paced by a continuous-batching
/// model, dcgm-exporter/vLLM/RoCE telemetry, and faults set through the control listener.
#[derive(Parser, Debug)]
#[command(name = "sluice-accel", version)]
struct Cli {
    /// The backend's name, sent in the x-sluice-backend header of every response.
    #[arg(long)]
    name: String,
    /// Serving listener (OpenAI API, /health, /metrics, /dcgm, /roce); repeatable.
    #[arg(long, required = true)]
    listen: Vec<SocketAddr>,
    /// Control listener: POST /fault, GET /state. Keep it off the VIP's path.
    #[arg(long)]
    control: SocketAddr,
    /// A slower accelerator from the start: every step takes 1/FACTOR as long (0 < FACTOR <= 1).
    #[arg(long, default_value_t = 1.0)]
    slow: f64,
    /// Seeds the GPU UUID and the words the model says.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// The model name reported in answers and in vLLM's model_name label.
    #[arg(long, default_value = "sluice-sim/llama-3.3-70b-fp8")]
    model: String,
    /// Prompt tokens prefilled per second.
    #[arg(long, default_value_t = Params::default().prefill_tokens_per_s)]
    prefill_tokens_per_s: f64,
    /// Fixed cost of a step (reading the weights), ms.
    #[arg(long, default_value_t = Params::default().step_base_ms)]
    step_base_ms: f64,
    /// Cost of each sequence in a step, ms.
    #[arg(long, default_value_t = Params::default().step_per_seq_ms)]
    step_per_seq_ms: f64,
    /// Cost of reading 1000 tokens of KV cache in a step, ms.
    #[arg(long, default_value_t = Params::default().step_per_ktoken_ms)]
    step_per_ktoken_ms: f64,
    /// KV cache size, tokens.
    #[arg(long, default_value_t = Params::default().kv_capacity_tokens)]
    kv_capacity_tokens: u64,
    /// Most sequences running at once.
    #[arg(long, default_value_t = Params::default().max_num_seqs)]
    max_num_seqs: usize,
    /// Token budget of a step (decodes plus prefill chunks).
    #[arg(long, default_value_t = Params::default().max_batched_tokens)]
    max_batched_tokens: u64,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    if !(cli.slow.is_finite() && cli.slow > 0.0 && cli.slow <= 1.0) {
        eprintln!(
            "error: --slow {} is out of range; allowed: 0 < FACTOR <= 1",
            cli.slow
        );
        return ExitCode::from(2);
    }
    let cfg = Config {
        name: cli.name,
        listen: cli.listen,
        control: cli.control,
        base_speed: cli.slow,
        seed: cli.seed,
        model: cli.model,
        params: Params {
            prefill_tokens_per_s: cli.prefill_tokens_per_s,
            step_base_ms: cli.step_base_ms,
            step_per_seq_ms: cli.step_per_seq_ms,
            step_per_ktoken_ms: cli.step_per_ktoken_ms,
            kv_capacity_tokens: cli.kv_capacity_tokens,
            max_num_seqs: cli.max_num_seqs,
            max_batched_tokens: cli.max_batched_tokens,
        },
    };
    let name = cfg.name.clone();
    let rt = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: starting the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let result = rt.block_on(server::run(cfg, |serving, control| {
        let list: Vec<String> = serving.iter().map(|a| a.to_string()).collect();
        // One line on stdout when every listener accepts: what scripts wait for.
        println!(
            "sluice-accel {name} ready: serving {} control {control}",
            list.join(",")
        );
    }));
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
