//! The matrix's fleets: each one's accelerators, answers, clients and load, and the capacity
//! and per-cell time estimated from the model's step cost.

use anyhow::{bail, Result};
use serde_json::{json, Value};
use sluice_accel::model::Params;

/// Answer lengths: log-normal (median, sigma) cut at a largest answer, in tokens.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Answers {
    /// Short answers (median 40, sigma 0.5): classification, extraction, short chat turns.
    Short,
    /// The load generator's chat workload (LMSYS-Chat-1M's mean, median 155, sigma 0.8), cut
    /// at 768 tokens (2% of answers) so that a cell does not wait a minute for its last
    /// stream.
    Chat,
    /// Heavy-tailed (median 155, sigma 1.4, cut at 768: a fifth of answers are longer than 500
    /// tokens): a few answers hold a batch slot for most of a run.
    HeavyTailed,
}

impl Answers {
    pub fn name(self) -> &'static str {
        match self {
            Answers::Short => "short",
            Answers::Chat => "chat",
            Answers::HeavyTailed => "heavy-tailed",
        }
    }

    /// (median, sigma, largest answer) of the load generator's answers.
    pub fn shape(self) -> (f64, f64, u32) {
        match self {
            Answers::Short => (40.0, 0.5, 1024),
            Answers::Chat => (155.0, 0.8, 768),
            Answers::HeavyTailed => (155.0, 1.4, 768),
        }
    }

    /// Mean answer tokens after the cut (sampled once; a test checks it against the
    /// generator's draws).
    pub fn mean_tokens(self) -> f64 {
        match self {
            Answers::Short => 45.3,
            Answers::Chat => 204.0,
            Answers::HeavyTailed => 262.0,
        }
    }

    /// The 99.9th percentile answer, tokens: about the longest stream a cell waits for.
    pub fn p999_tokens(self) -> f64 {
        let (median, sigma, max) = self.shape();
        (median * (3.09 * sigma).exp()).min(f64::from(max))
    }
}

/// A fleet: settings that differ where real fleets do. Passed to every accelerator
/// (`sluice-accel --max-num-seqs --step-per-seq-ms --kv-capacity-tokens`) and to the load
/// generator (`--output-median --output-sigma --max-output`, its sources and its rate).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Fleet {
    pub name: &'static str,
    /// The engine's batch limit (vLLM's max-num-seqs).
    pub max_num_seqs: u32,
    /// What each sequence adds to a step, ms: with the batch, how far a stream's pace falls
    /// as the batch grows.
    pub step_per_seq_ms: f64,
    pub kv_capacity_tokens: u64,
    /// Client source addresses (the VIP hashes by source).
    pub sources: u16,
    pub answers: Answers,
    /// Offered load, a fraction of the fleet's nominal capacity ([`Fleet::capacity_rps`]);
    /// idle, near-saturation and overload keep their own.
    pub load: f64,
}

/// The fleets, spanning the extremes rather than every combination: batch 16 (the first
/// four) and 64 (the last four) at several per-sequence costs, KV caches from 8192 to 32768
/// tokens, 32 / 180 / 1000 client sources, short to heavy-tailed answers, 40 / 65 / 85% load.
/// Batch-64 fleets pay a higher per-sequence cost: at the lab's pace a batch of 64 would
/// stream more tokens than a 2-core machine's load generator and simulators carry (a test
/// holds every fleet to 2600 answer tokens/s offered). Fleet `i` and `i + 4` differ in batch size, which the default
/// matrix pairs.
pub const FLEETS: [Fleet; 8] = [
    Fleet {
        name: "lab",
        max_num_seqs: 16,
        step_per_seq_ms: 0.1,
        kv_capacity_tokens: 8192,
        sources: 180,
        answers: Answers::Chat,
        load: 0.65,
    },
    Fleet {
        name: "few-clients-short",
        max_num_seqs: 16,
        step_per_seq_ms: 0.1,
        kv_capacity_tokens: 8192,
        sources: 32,
        answers: Answers::Short,
        load: 0.4,
    },
    Fleet {
        name: "few-clients-busy",
        max_num_seqs: 16,
        step_per_seq_ms: 0.1,
        kv_capacity_tokens: 8192,
        sources: 32,
        answers: Answers::Chat,
        load: 0.85,
    },
    Fleet {
        name: "many-clients-short-busy",
        max_num_seqs: 16,
        step_per_seq_ms: 0.4,
        kv_capacity_tokens: 16384,
        sources: 1000,
        answers: Answers::Short,
        load: 0.85,
    },
    Fleet {
        name: "wide-small-kv-heavy",
        max_num_seqs: 64,
        step_per_seq_ms: 0.8,
        kv_capacity_tokens: 8192,
        sources: 180,
        answers: Answers::HeavyTailed,
        load: 0.65,
    },
    Fleet {
        name: "wide-many-clients",
        max_num_seqs: 64,
        step_per_seq_ms: 0.8,
        kv_capacity_tokens: 32768,
        sources: 1000,
        answers: Answers::Chat,
        load: 0.65,
    },
    Fleet {
        name: "wide-costly-light",
        max_num_seqs: 64,
        step_per_seq_ms: 1.5,
        kv_capacity_tokens: 32768,
        sources: 32,
        answers: Answers::HeavyTailed,
        load: 0.4,
    },
    Fleet {
        name: "wide-heavy-busy",
        max_num_seqs: 64,
        step_per_seq_ms: 0.8,
        kv_capacity_tokens: 32768,
        sources: 180,
        answers: Answers::HeavyTailed,
        load: 0.85,
    },
];

/// The lab fleet's measured capacity, requests/s per accelerator (docs/benchmarks.md): the
/// other fleets' capacities scale from it by the model's cost of a request.
const LAB_CAPACITY_RPS: f64 = 3.0;

/// The lab fleet's engine as that capacity was measured (its answers: the generator's
/// chat workload, mean 214 tokens, uncut).
const LAB_ENGINE: (u32, f64, u64, f64) = (16, 0.1, 8192, 214.0);

/// Prompt tokens per request and KV tokens a running sequence holds beyond its answer
/// (the conversation so far): the chat workload's mean, an assumption for every fleet.
const PROMPT_TOKENS: f64 = 150.0;

/// The accelerators of a matrix cell (the steer benchmark's default).
const BACKENDS: f64 = 4.0;

/// A cell's time beyond its load and its longest stream: the lab's start and teardown.
pub(super) const CELL_OVERHEAD_S: f64 = 12.0;

/// One step of `n` running sequences of `ctx` tokens each, ms ([`sluice_accel::model`]'s
/// step cost, with the fleet's per-sequence cost).
fn step_ms(per_seq_ms: f64, n: f64, ctx: f64) -> f64 {
    let p = Params::default();
    p.step_base_ms + per_seq_ms * n + p.step_per_ktoken_ms * n * ctx / 1000.0
}

/// Seconds of an accelerator's time one request takes when its batch is full (or its KV
/// cache is): its answer's share of the decode steps plus its prefill.
fn request_cost_s(max_num_seqs: u32, per_seq_ms: f64, kv: u64, answer: f64) -> f64 {
    let ctx = PROMPT_TOKENS + answer;
    let n = f64::from(max_num_seqs).min(kv as f64 / ctx);
    let tokens_per_s = n / step_ms(per_seq_ms, n, ctx) * 1000.0;
    answer / tokens_per_s + PROMPT_TOKENS / Params::default().prefill_tokens_per_s
}

impl Fleet {
    /// Nominal capacity, requests/s per accelerator: the lab fleet's measured capacity scaled
    /// by the model's cost of a request in this fleet against the lab's. An estimate; the
    /// load fractions are of it.
    pub fn capacity_rps(&self) -> f64 {
        let (b, s, kv, answer) = LAB_ENGINE;
        let lab = request_cost_s(b, s, kv, answer);
        let this = request_cost_s(
            self.max_num_seqs,
            self.step_per_seq_ms,
            self.kv_capacity_tokens,
            self.answers.mean_tokens(),
        );
        LAB_CAPACITY_RPS * lab / this
    }

    /// Answer tokens per second the fleet is offered at its load.
    pub fn offered_tokens_per_s(&self) -> f64 {
        self.load * BACKENDS * self.capacity_rps() * self.answers.mean_tokens()
    }

    /// About how long a cell waits for its last stream after the load ends: the longest
    /// answer at the step time of the batch the load keeps running.
    pub fn drain_s(&self) -> f64 {
        let ctx = PROMPT_TOKENS + self.answers.mean_tokens();
        let full = f64::from(self.max_num_seqs).min(self.kv_capacity_tokens as f64 / ctx);
        let n = (full * self.load).max(1.0);
        self.answers.p999_tokens() * step_ms(self.step_per_seq_ms, n, ctx) / 1000.0
    }

    pub fn accel_args(&self) -> Vec<String> {
        vec![
            "--max-num-seqs".into(),
            self.max_num_seqs.to_string(),
            "--step-per-seq-ms".into(),
            self.step_per_seq_ms.to_string(),
            "--kv-capacity-tokens".into(),
            self.kv_capacity_tokens.to_string(),
        ]
    }

    pub fn tokens_args(&self) -> Vec<String> {
        let (median, sigma, max) = self.answers.shape();
        vec![
            "--output-median".into(),
            median.to_string(),
            "--output-sigma".into(),
            sigma.to_string(),
            "--max-output".into(),
            max.to_string(),
        ]
    }

    /// The fleet's settings, as each cell of the result names them.
    pub fn json(&self) -> Value {
        let (median, sigma, max) = self.answers.shape();
        json!({
            "name": self.name,
            "max_num_seqs": self.max_num_seqs,
            "step_per_seq_ms": self.step_per_seq_ms,
            "kv_capacity_tokens": self.kv_capacity_tokens,
            "client_sources": self.sources,
            "answers": {"kind": self.answers.name(), "median": median, "sigma": sigma,
                        "max": max},
            "load": self.load,
            "capacity_rps_per_backend": (self.capacity_rps() * 1000.0).round() / 1000.0,
            "accel_args": self.accel_args().join(" "),
            "tokens_args": self.tokens_args().join(" "),
        })
    }

    pub fn parse(s: &str) -> Result<Fleet> {
        match FLEETS.iter().find(|f| f.name == s) {
            Some(f) => Ok(*f),
            None => bail!(
                "unknown fleet {s:?}; known: {}",
                FLEETS.map(|f| f.name).join(", ")
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tokens::workload::{Generator, Shape};

    /// Tokens per second the load generator, daemon and four simulators carry on a 2-core
    /// machine (docs/benchmarks.md, lab scale), with some headroom.
    const MACHINE_TOKENS_PER_S: f64 = 2600.0;

    #[test]
    fn fleets_span_the_extremes_and_fit_the_machine() {
        let names: Vec<&str> = FLEETS.iter().map(|f| f.name).collect();
        let mut unique = names.clone();
        unique.sort();
        unique.dedup();
        assert_eq!(unique.len(), FLEETS.len(), "{names:?}");
        let has = |p: &dyn Fn(&Fleet) -> bool| FLEETS.iter().any(p);
        for b in [16, 64] {
            assert!(has(&|f| f.max_num_seqs == b), "batch {b}");
        }
        for n in [32, 180, 1000] {
            assert!(has(&|f| f.sources == n), "{n} sources");
        }
        for l in [0.4, 0.65, 0.85] {
            assert!(has(&|f| f.load == l), "load {l}");
        }
        for a in [Answers::Short, Answers::HeavyTailed] {
            assert!(has(&|f| f.answers == a), "{a:?}");
        }
        // The default matrix pairs fleet i with i + 4: a batch of 16 with one of 64.
        for i in 0..4 {
            assert_eq!(
                (FLEETS[i].max_num_seqs, FLEETS[i + 4].max_num_seqs),
                (16, 64)
            );
        }
        for f in FLEETS {
            let t = f.offered_tokens_per_s();
            assert!(t <= MACHINE_TOKENS_PER_S, "{}: {t:.0} tokens/s", f.name);
            assert_eq!(Fleet::parse(f.name).unwrap(), f);
        }
        assert!(Fleet::parse("huge")
            .unwrap_err()
            .to_string()
            .contains("known: lab"));
    }

    #[test]
    fn capacity_scales_from_the_lab_fleets_measurement() {
        let lab = Fleet {
            answers: Answers::Chat,
            ..FLEETS[0]
        };
        // The lab fleet's engine, as measured; its answers cut at 1024 tokens are a little
        // shorter than the measurement's, so a little more fits.
        let (b, s, kv, _) = LAB_ENGINE;
        assert_eq!(
            (
                lab.max_num_seqs,
                lab.step_per_seq_ms,
                lab.kv_capacity_tokens
            ),
            (b, s, kv)
        );
        let c = lab.capacity_rps();
        assert!((3.0..3.2).contains(&c), "{c}");
        // Shorter answers: more requests; a wider batch: more; a costlier sequence: fewer;
        // a KV cache too small for the batch: fewer than the batch allows.
        let short = Fleet {
            answers: Answers::Short,
            ..lab
        };
        assert!(short.capacity_rps() > 3.0 * lab.capacity_rps());
        let wide = Fleet {
            max_num_seqs: 64,
            kv_capacity_tokens: 32768,
            ..lab
        };
        assert!(wide.capacity_rps() > 2.0 * lab.capacity_rps());
        let costly = Fleet {
            step_per_seq_ms: 1.0,
            ..wide
        };
        assert!(costly.capacity_rps() < wide.capacity_rps());
        let small_kv = Fleet {
            kv_capacity_tokens: 8192,
            ..wide
        };
        assert!(small_kv.capacity_rps() < 0.5 * wide.capacity_rps());
    }

    #[test]
    fn answer_means_match_the_generators_draws() {
        for a in [Answers::Short, Answers::Chat, Answers::HeavyTailed] {
            let (median, sigma, max) = a.shape();
            let shape = Shape {
                output_median: median,
                output_sigma: sigma,
                max_output: max,
                ..Shape::default()
            };
            let mut g = Generator::new(shape, 1).unwrap();
            let firsts: Vec<f64> = (0..20_000)
                .map(|_| f64::from(g.conversation()[0].max_tokens))
                .collect();
            let mean = firsts.iter().sum::<f64>() / firsts.len() as f64;
            assert!(
                (mean / a.mean_tokens() - 1.0).abs() < 0.04,
                "{a:?}: drawn mean {mean}, table {}",
                a.mean_tokens()
            );
        }
    }
}
