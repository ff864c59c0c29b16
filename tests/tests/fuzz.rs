//! `sluice_xdp` and `sluice_decap` under fuzzed frames, through BPF_PROG_TEST_RUN, checked
//! frame by frame against the oracles in `sluice_tests::fuzz`. The seed is printed; `SLUICE_FUZZ_SEED` replays a run
//! and `SLUICE_FUZZ_FRAMES` changes its length (`cargo xtask fuzz --frames N` runs long ones).

use lb_common::stat::Kind;
use sluice_tests::fuzz;

#[test]
fn fuzzed_frames_meet_the_oracle_and_every_frame_has_one_outcome() {
    let seed = fuzz::seed_from_env().unwrap();
    let frames = fuzz::frames_from_env(fuzz::SUITE_FRAMES).unwrap();
    eprintln!("fuzz: {frames} frames, seed {seed:#x} (replay: SLUICE_FUZZ_SEED={seed:#x})");
    let s = fuzz::run(frames, seed).unwrap_or_else(|e| panic!("{e:#}"));
    eprintln!(
        "fuzz: {} frames in {:.1} s: {} passed, {} dropped, {} sent; counters {:?}",
        s.frames,
        s.elapsed.as_secs_f64(),
        s.outcomes(Kind::Pass),
        s.outcomes(Kind::Drop),
        s.outcomes(Kind::Sent),
        s.counters
    );
    // The generator reaches every path the oracle is meant to judge.
    if frames >= fuzz::SUITE_FRAMES {
        for c in [
            "pass_not_ip",
            "pass_not_vip",
            "pass_truncated_l3",
            "pass_truncated_l4",
            "pass_bad_ip_len",
            "pass_short_ip_len",
            "pass_fragment",
            "pass_unsupported_l4",
            "pass_ext_hdr_limit",
            "pass_icmp_not_vip",
            "icmp_too_big_steered",
            "padding_trimmed",
            "conn_hit",
            "conn_resteer_down",
            "probe_skip",
            "drop_no_backend",
            "shed_priority",
            "shed_rst_sent",
            "drop_shed",
            "tx",
            "redirect",
            "icmp_too_big_sent",
            "drop_frag_needed",
            "quic_cid_routed",
            "quic_client_cid",
            "quic_unknown_rotation",
            "quic_unknown_server",
            "quic_server_down",
            "quic_malformed",
            "shed_tenant_sessions",
            "shed_tenant_share",
            "shed_tenant_rate",
        ] {
            assert!(
                s.counters.get(c).copied().unwrap_or(0) > 0,
                "no fuzzed frame reached {c}"
            );
        }
    }
    if let Ok(path) = std::env::var("SLUICE_FUZZ_RECORD") {
        fuzz::record(&s, std::path::Path::new(&path)).unwrap();
        eprintln!("fuzz: result written to {path}");
    }
}

#[test]
fn fuzzed_tunnel_frames_are_decapsulated_exactly_when_their_lengths_agree() {
    let seed = fuzz::seed_from_env().unwrap();
    let frames = fuzz::frames_from_env(fuzz::SUITE_FRAMES).unwrap() / 4;
    eprintln!("decap fuzz: {frames} frames, seed {seed:#x} (replay: SLUICE_FUZZ_SEED={seed:#x})");
    let counters = fuzz::run_decap(frames, seed).unwrap_or_else(|e| panic!("{e:#}"));
    eprintln!("decap fuzz: counters {counters:?}");
    if frames >= fuzz::SUITE_FRAMES / 4 {
        for c in ["decap_ok", "decap_pass_not_encap", "decap_pass_bad_len"] {
            assert!(
                counters.get(c).copied().unwrap_or(0) > 0,
                "no fuzzed tunnel frame reached {c}"
            );
        }
    }
}
