//! The seeded workload: conversations of several turns, each turn a prompt and an answer
//! length drawn from log-normal distributions, with think time between turns, arriving as a
//! Poisson process (open loop).
//!
//! Defaults and where they come from:
//! - LMSYS-Chat-1M's dataset card (huggingface.co/datasets/lmsys/lmsys-chat-1m, "Basic
//!   Statistics"; Llama 2 tokenizer) gives 2.0 turns per conversation, 69.5 tokens per user
//!   prompt and 214.5 tokens per response on average. The vLLM paper (Kwon et al., SOSP 2023,
//!   Fig. 11) gives ShareGPT means of 161.31 input and 337.99 output tokens; its inputs include
//!   the conversation so far, as ours do (below).
//! - The spreads are assumptions: sigma 1.0 for prompts and 0.8 for answers (heavy right
//!   tails as both papers' histograms show). The medians follow from the means and the
//!   spreads: a log-normal's mean is median x exp(sigma^2 / 2), so a 69.5-token mean with
//!   sigma 1.0 is a median of 42 tokens, a 214.5-token mean with sigma 0.8 a median of 155.
//! - Turns: geometric with a mean of 2.0 (the distribution is an assumption; the mean is
//!   LMSYS's).
//! - Think time between turns: exponential with a mean of 3 s (an assumption, scaled to keep
//!   a one-minute run's conversations inside the run).
//!
//! Each turn's prompt carries the conversation so far (earlier prompts and answers) plus the
//! new user message, as a chat client resends history; it is capped at `max_context` tokens
//! minus the answer, dropping the oldest history, as chat front ends truncate.

use rand::{rngs::StdRng, RngExt, SeedableRng};
use rand_distr::{Distribution, Exp, LogNormal};

/// The workload's shape.
#[derive(Clone, Debug, PartialEq)]
pub struct Shape {
    pub prompt_median: f64,
    pub prompt_sigma: f64,
    pub output_median: f64,
    pub output_sigma: f64,
    /// Mean turns per conversation, >= 1.
    pub turns_mean: f64,
    /// Mean think time between turns, ms.
    pub think_ms: f64,
    /// Largest prompt + answer of one request, tokens.
    pub max_context: u32,
    /// Bounds of one draw, tokens.
    pub max_prompt: u32,
    pub max_output: u32,
}

impl Default for Shape {
    fn default() -> Self {
        Shape {
            prompt_median: 42.0,
            prompt_sigma: 1.0,
            output_median: 155.0,
            output_sigma: 0.8,
            turns_mean: 2.0,
            think_ms: 3000.0,
            max_context: 8192,
            max_prompt: 4096,
            max_output: 2048,
        }
    }
}

impl Shape {
    /// Turns mean from a median instead: the geometric distribution whose median is `m`
    /// continues with probability 0.5^(1/m), so its mean is 1 / (1 - 0.5^(1/m)).
    pub fn turns_mean_from_median(m: f64) -> f64 {
        1.0 / (1.0 - 0.5f64.powf(1.0 / m))
    }

    pub fn validate(&self) -> Result<(), String> {
        let mut bad = Vec::new();
        for (name, v) in [
            ("prompt median", self.prompt_median),
            ("output median", self.output_median),
        ] {
            if !(v.is_finite() && v >= 1.0) {
                bad.push(format!("{name} {v} must be >= 1 token"));
            }
        }
        for (name, v) in [
            ("prompt sigma", self.prompt_sigma),
            ("output sigma", self.output_sigma),
        ] {
            if !(v.is_finite() && (0.0..=4.0).contains(&v)) {
                bad.push(format!("{name} {v} must be in 0..=4"));
            }
        }
        if !(self.turns_mean.is_finite() && self.turns_mean >= 1.0) {
            bad.push(format!("turns mean {} must be >= 1", self.turns_mean));
        }
        if !(self.think_ms.is_finite() && self.think_ms >= 0.0) {
            bad.push(format!("think time {} ms must be >= 0", self.think_ms));
        }
        if self.max_output == 0 || self.max_prompt == 0 {
            bad.push("the largest prompt and answer must be at least 1 token".into());
        }
        if self.max_context < self.max_output.saturating_add(1) {
            bad.push(format!(
                "max context {} must exceed the largest answer {}",
                self.max_context, self.max_output
            ));
        }
        if bad.is_empty() {
            Ok(())
        } else {
            Err(bad.join("; "))
        }
    }
}

/// One request of a conversation.
#[derive(Clone, Debug, PartialEq)]
pub struct Turn {
    /// Prompt tokens sent: history plus the new message.
    pub prompt_tokens: u32,
    /// The new message's tokens (the end of the prompt; all of it when the cap cut in).
    pub message_tokens: u32,
    pub max_tokens: u32,
    /// Think time before this turn (0 for the first), ms.
    pub think_ms: f64,
}

/// Draws conversations and arrival gaps from one seeded generator.
pub struct Generator {
    rng: StdRng,
    shape: Shape,
    prompt: LogNormal<f64>,
    output: LogNormal<f64>,
    think: Option<Exp<f64>>,
}

impl Generator {
    pub fn new(shape: Shape, seed: u64) -> Result<Generator, String> {
        shape.validate()?;
        let ln = |median: f64, sigma: f64| {
            LogNormal::new(median.ln(), sigma).map_err(|e| format!("log-normal: {e}"))
        };
        Ok(Generator {
            rng: StdRng::seed_from_u64(seed),
            prompt: ln(shape.prompt_median, shape.prompt_sigma)?,
            output: ln(shape.output_median, shape.output_sigma)?,
            think: (shape.think_ms > 0.0)
                .then(|| Exp::new(1.0 / shape.think_ms))
                .transpose()
                .map_err(|e| format!("exponential: {e}"))?,
            shape,
        })
    }

    fn tokens(&mut self, d: LogNormal<f64>, max: u32) -> u32 {
        (d.sample(&mut self.rng).round() as u32).clamp(1, max)
    }

    pub fn conversation(&mut self) -> Vec<Turn> {
        // Geometric on 1, 2, ...: another turn with probability 1 - 1/mean.
        let more = 1.0 - 1.0 / self.shape.turns_mean;
        let mut turns = Vec::new();
        let mut history = 0u32;
        loop {
            let message = self.tokens(self.prompt, self.shape.max_prompt);
            let answer = self.tokens(self.output, self.shape.max_output);
            let room = self.shape.max_context - answer;
            let prompt_tokens = history.saturating_add(message).min(room);
            let think_ms = match (&self.think, turns.is_empty()) {
                (Some(t), false) => t.sample(&mut self.rng),
                _ => 0.0,
            };
            turns.push(Turn {
                prompt_tokens,
                message_tokens: message.min(prompt_tokens),
                max_tokens: answer,
                think_ms,
            });
            history = history.saturating_add(message + answer);
            if self.rng.random::<f64>() >= more {
                return turns;
            }
        }
    }

    /// The gap before the next arrival of a Poisson process of `rate` per second, seconds.
    pub fn arrival_gap_s(&mut self, rate: f64) -> f64 {
        Exp::new(rate).map_or(f64::INFINITY, |d| d.sample(&mut self.rng))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn median(mut v: Vec<f64>) -> f64 {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    }

    #[test]
    fn log_normal_draws_have_the_asked_median_and_spread() {
        let shape = Shape {
            turns_mean: 1.0,
            max_context: 1 << 20,
            max_prompt: 1 << 19,
            max_output: 1 << 19,
            ..Shape::default()
        };
        let mut g = Generator::new(shape, 7).unwrap();
        let (mut p, mut o) = (Vec::new(), Vec::new());
        for _ in 0..20_000 {
            let t = g.conversation();
            assert_eq!(t.len(), 1);
            p.push(t[0].prompt_tokens as f64);
            o.push(t[0].max_tokens as f64);
        }
        let (mp, mo) = (median(p.clone()), median(o.clone()));
        assert!((mp - 42.0).abs() <= 2.0, "prompt median {mp}");
        assert!((mo - 155.0).abs() <= 5.0, "output median {mo}");
        // Means follow median x exp(sigma^2/2): 69.2 and 213.2 (LMSYS: 69.5 and 214.5).
        let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len() as f64;
        assert!((mean(&p) - 69.5).abs() < 4.0, "prompt mean {}", mean(&p));
        assert!((mean(&o) - 214.5).abs() < 8.0, "output mean {}", mean(&o));
        // The spread: the log's standard deviation is sigma.
        let logs: Vec<f64> = o.iter().map(|x| x.ln()).collect();
        let m = mean(&logs);
        let sd = (logs.iter().map(|x| (x - m).powi(2)).sum::<f64>() / logs.len() as f64).sqrt();
        assert!((sd - 0.8).abs() < 0.03, "sd {sd}");
    }

    #[test]
    fn poisson_arrivals_have_the_asked_rate_and_exponential_gaps() {
        let mut g = Generator::new(Shape::default(), 1).unwrap();
        let gaps: Vec<f64> = (0..50_000).map(|_| g.arrival_gap_s(20.0)).collect();
        let mean = gaps.iter().sum::<f64>() / gaps.len() as f64;
        assert!((mean - 0.05).abs() < 0.002, "mean gap {mean}");
        // Exponential: the coefficient of variation is 1, and P(gap > mean) = 1/e.
        let sd = (gaps.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / gaps.len() as f64).sqrt();
        assert!((sd / mean - 1.0).abs() < 0.03, "cv {}", sd / mean);
        let above = gaps.iter().filter(|&&x| x > 0.05).count() as f64 / gaps.len() as f64;
        assert!((above - (-1.0f64).exp()).abs() < 0.01, "{above}");
    }

    #[test]
    fn conversations_carry_history_and_think_time() {
        let mut g = Generator::new(Shape::default(), 3).unwrap();
        let convs: Vec<Vec<Turn>> = (0..20_000).map(|_| g.conversation()).collect();
        let mean_turns = convs.iter().map(Vec::len).sum::<usize>() as f64 / convs.len() as f64;
        assert!((mean_turns - 2.0).abs() < 0.05, "{mean_turns}");
        let multi = convs.iter().find(|c| c.len() >= 3).unwrap();
        assert_eq!(multi[0].think_ms, 0.0);
        assert!(multi[1].think_ms > 0.0 && multi[2].think_ms > 0.0);
        // Each later prompt holds the earlier turns: strictly more than the first answer.
        assert!(multi[1].prompt_tokens > multi[0].max_tokens);
        assert!(multi[2].prompt_tokens > multi[1].prompt_tokens);
        for c in &convs {
            for t in c {
                assert!(t.prompt_tokens >= 1 && t.max_tokens >= 1);
                assert!(t.prompt_tokens + t.max_tokens <= 8192, "{t:?}");
            }
        }
        let thinks: Vec<f64> = convs
            .iter()
            .flat_map(|c| c.iter().skip(1).map(|t| t.think_ms))
            .collect();
        let mean = thinks.iter().sum::<f64>() / thinks.len() as f64;
        assert!((mean - 3000.0).abs() < 150.0, "think mean {mean}");
    }

    #[test]
    fn the_same_seed_gives_the_same_workload() {
        let draw = |seed| {
            let mut g = Generator::new(Shape::default(), seed).unwrap();
            (0..50).map(|_| g.conversation()).collect::<Vec<_>>()
        };
        assert_eq!(draw(9), draw(9));
        assert_ne!(draw(9), draw(10));
    }

    #[test]
    fn turns_median_maps_to_a_mean() {
        assert!((Shape::turns_mean_from_median(1.0) - 2.0).abs() < 1e-12);
        // Median 2: continue with 0.5^(1/2) = 0.707, mean 3.41.
        assert!((Shape::turns_mean_from_median(2.0) - 3.414).abs() < 1e-3);
        let e = Shape {
            prompt_sigma: -1.0,
            turns_mean: 0.5,
            ..Shape::default()
        }
        .validate()
        .unwrap_err();
        assert!(
            e.contains("prompt sigma -1") && e.contains("turns mean 0.5"),
            "{e}"
        );
    }
}
