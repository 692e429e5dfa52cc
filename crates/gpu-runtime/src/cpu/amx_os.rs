//! What Intel AMX (Advanced Matrix Extensions) this CPU and OS give the
//! process, and the per-thread tile configuration every AMX kernel loads.
//! Shared by the bf16 GEMM (`gemm_bf16/amx.rs`, `tdpbf16ps`) and the
//! quantized products (`quant/tiles/`, `tdpbssd`).
//!
//! The tile registers are per thread state the kernels must ask Linux for
//! (`arch_prctl(ARCH_REQ_XCOMP_PERM)`, once per process) and configure per
//! thread ([`Tiles`]); the compiler never uses them, so they hold their
//! values between `asm!` blocks.

use std::arch::asm;
use std::sync::OnceLock;

/// An AMX unit the kernels use beside the tiles themselves.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Unit {
    /// AMX-BF16: `tdpbf16ps`.
    Bf16,
    /// AMX-INT8: `tdpbssd` and its signedness variants.
    Int8,
}

/// Whether this CPU and OS run `unit`'s tiles for this process: CPUID's
/// AMX-TILE and the unit, the OS's tile state enabled in XCR0, and Linux
/// granting the process the tile data (asked once).
pub(crate) fn available(unit: Unit) -> bool {
    // CPUID exits to the hypervisor in a VM (microseconds): asked once.
    static UNITS: OnceLock<(bool, bool)> = OnceLock::new();
    let (bf16, int8) = *UNITS.get_or_init(|| {
        let (tile, bf16, int8) = cpuid_bits();
        let granted = tile && (bf16 || int8) && grant();
        (granted && bf16, granted && int8)
    });
    match unit {
        Unit::Bf16 => bf16,
        Unit::Int8 => int8,
    }
}

/// CPUID.(7,0):EDX's AMX-TILE (bit 24), AMX-BF16 (22) and AMX-INT8 (25),
/// false where XGETBV is unusable.
fn cpuid_bits() -> (bool, bool, bool) {
    use std::arch::x86_64::{__cpuid, __cpuid_count};
    // CPUID.1:ECX.OSXSAVE (bit 27): XGETBV is usable.
    if __cpuid(1).ecx & (1 << 27) == 0 || __cpuid(0).eax < 7 {
        return (false, false, false);
    }
    let edx = __cpuid_count(7, 0).edx;
    (
        edx & (1 << 24) != 0,
        edx & (1 << 22) != 0,
        edx & (1 << 25) != 0,
    )
}

/// The OS's tile state on (XCR0) and granted to this process.
/// Only called where `cpuid_bits` found AMX-TILE (so OSXSAVE is set).
fn grant() -> bool {
    use std::arch::x86_64::_xgetbv;
    // SAFETY: OSXSAVE is set (the caller's `cpuid_bits` checked it), so
    // XGETBV runs.
    let xcr0 = unsafe { _xgetbv(0) };
    const XTILE: u64 = (1 << 17) | (1 << 18); // XTILECFG, XTILEDATA
    if xcr0 & XTILE != XTILE {
        return false;
    }
    let granted = request_tile_data();
    if !granted {
        // A thread's signal stack too small for the tile state (ENOSPC), or
        // a kernel without AMX support: the other kernels serve.
        tracing::info!("the CPU has AMX tiles but the OS did not grant them; matmuls use AVX-512");
    }
    granted
}

/// Asks Linux for the tile data state (`ARCH_REQ_XCOMP_PERM`), then reads
/// the permission back (`ARCH_GET_XCOMP_PERM`).
#[cfg(target_os = "linux")]
fn request_tile_data() -> bool {
    const ARCH_GET_XCOMP_PERM: libc::c_long = 0x1022;
    const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
    const XFEATURE_XTILEDATA: libc::c_long = 18;
    // SAFETY: `arch_prctl` with these codes takes a feature number, or a
    // pointer to a u64 it writes; `perm` outlives the call.
    unsafe {
        if libc::syscall(
            libc::SYS_arch_prctl,
            ARCH_REQ_XCOMP_PERM,
            XFEATURE_XTILEDATA,
        ) != 0
        {
            return false;
        }
        let mut perm: u64 = 0;
        libc::syscall(
            libc::SYS_arch_prctl,
            ARCH_GET_XCOMP_PERM,
            &mut perm as *mut u64,
        ) == 0
            && perm & (1 << XFEATURE_XTILEDATA) != 0
    }
}

#[cfg(not(target_os = "linux"))]
fn request_tile_data() -> bool {
    false
}

/// A 64-byte tile configuration (palette 1): per tile register, its rows
/// and bytes a row (0 and 0: unused).
#[repr(C, align(64))]
pub(crate) struct Config([u8; 64]);

impl Config {
    /// `shapes[t] = (rows, bytes per row)` of tile `t`.
    pub(crate) fn new(shapes: [(u8, u16); 8]) -> Config {
        let mut c = [0u8; 64];
        c[0] = 1; // palette
        for (t, (rows, bytes)) in shapes.into_iter().enumerate() {
            c[16 + 2 * t..18 + 2 * t].copy_from_slice(&bytes.to_le_bytes());
            c[48 + t] = rows;
        }
        Config(c)
    }
}

/// This thread's tile registers, configured while alive and released
/// (back to their initial state, which context switches then need not
/// save) when dropped. Not `Send`: the configuration is the thread's.
pub(crate) struct Tiles {
    _thread_bound: std::marker::PhantomData<*const ()>,
}

impl Tiles {
    /// Loads `config` into this thread's tile registers.
    ///
    /// # Safety
    /// [`available`] must have returned true for the units the kernels
    /// run on these tiles, and `config` must be valid for them (every
    /// shape within 16 rows of 64 bytes).
    pub(crate) unsafe fn configure(config: &Config) -> Tiles {
        // SAFETY: AMX is available and permitted (the caller's contract);
        // `config` is a 64-byte palette-1 configuration.
        unsafe { asm!("ldtilecfg [{}]", in(reg) config.0.as_ptr(), options(nostack)) };
        Tiles {
            _thread_bound: std::marker::PhantomData,
        }
    }
}

impl Drop for Tiles {
    fn drop(&mut self) {
        // SAFETY: tiles were configured by `configure`, so AMX is available.
        unsafe { asm!("tilerelease", options(nostack, nomem)) };
    }
}
