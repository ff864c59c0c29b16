//! The compiled eBPF programs.

/// Sluice's BPF ELF object (the XDP steering program, the decapsulation program and their
/// maps), as built by `cargo xtask build` into `target/bpf/sluice.bpf.o` (or taken from
/// `$SLUICE_BPF_OBJECT` at build time) and embedded by `build.rs`. Aligned as
/// `aya::Ebpf::load` needs.
pub static BPF_OBJECT: &[u8] =
    aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/sluice.bpf.o"));
