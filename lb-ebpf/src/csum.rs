//! One's-complement sums for the headers the data plane writes. Words are summed as they lie
//! in memory: the sum is byte-order independent, so no swapping is needed.

/// Adds a 32-bit word (as two 16-bit halves) to a running sum.
#[inline(always)]
pub fn add32(sum: u32, w: u32) -> u32 {
    sum + (w & 0xffff) + (w >> 16)
}

#[inline(always)]
pub fn add_all<const N: usize>(mut sum: u32, words: &[u32; N]) -> u32 {
    for w in words {
        sum = add32(sum, *w);
    }
    sum
}

/// The checksum field's value for a sum.
#[inline(always)]
pub fn fold(mut s: u32) -> u16 {
    s = (s & 0xffff) + (s >> 16);
    s = (s & 0xffff) + (s >> 16);
    !(s as u16)
}
