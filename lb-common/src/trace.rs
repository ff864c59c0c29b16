//! Decision tracing in aya-log's record format, so the userspace `aya-log` crate reads what
//! the data plane writes into its `AYA_LOGS` ring buffer. aya-log-ebpf's own macros cannot
//! be used: built for the host target and retargeted, its ring buffer is not a map (see
//! docs/design.md). A record here is one fixed layout: a template whose variable arguments
//! the program fills in, so the verifier sees constant offsets.
//!
//! The tags are aya-log-common 0.2's (`RecordFieldKind`, `Level`, `ArgumentKind`,
//! `DisplayHint`, lengths as `u16`); the userspace test parses records with aya-log itself.

/// `RecordFieldKind`.
mod field {
    pub const TARGET: u8 = 0;
    pub const LEVEL: u8 = 1;
    pub const MODULE: u8 = 2;
    pub const FILE: u8 = 3;
    pub const LINE: u8 = 4;
    pub const NUM_ARGS: u8 = 5;
}

/// `ArgumentKind`.
mod arg {
    pub const DISPLAY_HINT: u8 = 0;
    pub const U16: u8 = 7;
    pub const U32: u8 = 8;
    pub const ARR_U8_LEN16: u8 = 17;
    pub const STR: u8 = 20;
}

/// `Level::Info`.
const LEVEL_INFO: u8 = 3;
/// `DisplayHint::Ip`.
const HINT_IP: u8 = 4;

/// One tagged value: kind, length, bytes.
#[repr(C, packed)]
#[derive(Clone, Copy)]
pub struct Field<const N: usize> {
    pub tag: u8,
    pub len: u16,
    pub value: [u8; N],
}

impl<const N: usize> Field<N> {
    const fn new(tag: u8, value: [u8; N]) -> Self {
        Field {
            tag,
            len: N as u16,
            value,
        }
    }
}

const fn text<const N: usize>(s: &str) -> Field<N> {
    let b = s.as_bytes();
    let mut v = [0u8; N];
    let mut i = 0;
    while i < N {
        v[i] = b[i];
        i += 1;
    }
    Field::new(arg::STR, v)
}

/// "flow {client}:{sport} to vip {vip} port {dport} -> backend {backend} {new|est}", at
/// level info, target `sluice::dataplane`. IPv4 clients show as `::ffff:a.b.c.d`.
#[repr(C, packed)]
#[derive(Clone, Copy)]
pub struct DecisionRecord {
    size: u16,
    target: Field<17>,
    level: Field<1>,
    module: Field<10>,
    file: Field<8>,
    line: Field<4>,
    num_args: Field<4>,
    flow: Field<5>,
    hint: Field<1>,
    pub client: Field<16>,
    colon: Field<1>,
    pub sport: Field<2>,
    to_vip: Field<8>,
    pub vip: Field<4>,
    port: Field<6>,
    pub dport: Field<2>,
    to_backend: Field<12>,
    pub backend: Field<4>,
    space: Field<1>,
    pub kind: Field<3>,
}

pub const NEW: [u8; 3] = *b"new";
pub const ESTABLISHED: [u8; 3] = *b"est";

impl DecisionRecord {
    /// The record with its variable arguments zero.
    pub const TEMPLATE: DecisionRecord = DecisionRecord {
        size: core::mem::size_of::<DecisionRecord>() as u16,
        target: Field::new(field::TARGET, *b"sluice::dataplane"),
        level: Field::new(field::LEVEL, [LEVEL_INFO]),
        module: Field::new(field::MODULE, *b"sluice_xdp"),
        file: Field::new(field::FILE, *b"steer.rs"),
        line: Field::new(field::LINE, 0u32.to_ne_bytes()),
        num_args: Field::new(field::NUM_ARGS, 13u32.to_ne_bytes()),
        flow: text("flow "),
        hint: Field::new(arg::DISPLAY_HINT, [HINT_IP]),
        client: Field::new(arg::ARR_U8_LEN16, [0; 16]),
        colon: text(":"),
        sport: Field::new(arg::U16, [0; 2]),
        to_vip: text(" to vip "),
        vip: Field::new(arg::U32, [0; 4]),
        port: text(" port "),
        dport: Field::new(arg::U16, [0; 2]),
        to_backend: text(" -> backend "),
        backend: Field::new(arg::U32, [0; 4]),
        space: text(" "),
        kind: Field::new(arg::STR, NEW),
    };
}
