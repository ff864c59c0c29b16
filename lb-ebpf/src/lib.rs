#![no_std]

use aya_ebpf::{bindings::xdp_action, macros::{map, xdp}, maps::PerCpuArray, programs::XdpContext};

#[map]
pub static PASS_COUNT: PerCpuArray<u64> = PerCpuArray::with_max_entries(1, 0);

#[xdp]
pub fn sluice_pass(_ctx: XdpContext) -> u32 {
    if let Some(c) = PASS_COUNT.get_ptr_mut(0) {
        unsafe { *c += 1 };
    }
    xdp_action::XDP_PASS
}

#[panic_handler]
fn panic(_: &core::panic::PanicInfo) -> ! {
    loop {}
}
