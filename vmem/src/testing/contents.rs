//! What the conformance suite reads and writes through: a backend's mapped memory, checked
//! against a pattern ([`Contents`]; the host backend's, [`HostContents`]).

use crate::backend::HostBackend;
use crate::Result;

/// Reads and writes a backend's mapped memory, to check that contents follow pages.
pub trait Contents {
    /// Fills `[addr, addr + len)` with a pattern derived from `seed`.
    ///
    /// # Safety
    /// The span is mapped read/write for the whole call.
    unsafe fn fill(&self, addr: u64, len: u64, seed: u32) -> Result<()>;

    /// Counts the 4-byte words of `[addr, addr + len)` that differ from `seed`'s pattern.
    ///
    /// # Safety
    /// The span is mapped readable for the whole call.
    unsafe fn check(&self, addr: u64, len: u64, seed: u32) -> Result<u64>;

    /// Counts the non-zero bytes of `[addr, addr + len)`, read as a kernel would (zero-page
    /// slots included).
    ///
    /// # Safety
    /// The span is mapped readable for the whole call.
    unsafe fn nonzero(&self, addr: u64, len: u64) -> Result<u64>;
}

/// The pattern word `i` of a span filled with `seed` holds (the GPU kernels use the same).
pub fn pattern_word(i: u64, seed: u32) -> u32 {
    (i as u32).wrapping_mul(0x9E37_79B1) ^ seed
}

/// [`Contents`] of the host backend, through its checked `read` and `write`.
#[derive(Debug)]
pub struct HostContents<'a>(pub &'a HostBackend);

impl Contents for HostContents<'_> {
    unsafe fn fill(&self, addr: u64, len: u64, seed: u32) -> Result<()> {
        let bytes: Vec<u8> = (0..len / 4)
            .flat_map(|i| pattern_word(i, seed).to_le_bytes())
            .collect();
        self.0.write(addr, &bytes)
    }

    unsafe fn check(&self, addr: u64, len: u64, seed: u32) -> Result<u64> {
        let mut bytes = vec![0u8; len as usize];
        self.0.read(addr, &mut bytes)?;
        Ok(bytes
            .chunks_exact(4)
            .enumerate()
            .filter(|(i, w)| {
                u32::from_le_bytes([w[0], w[1], w[2], w[3]]) != pattern_word(*i as u64, seed)
            })
            .count() as u64)
    }

    unsafe fn nonzero(&self, addr: u64, len: u64) -> Result<u64> {
        // SAFETY: by the caller's contract the span is mapped readable.
        let bytes = unsafe { read_host(addr, len as usize) };
        Ok(bytes.iter().filter(|&&b| b != 0).count() as u64)
    }
}

/// Reads `len` bytes of host-backend memory at `addr` with plain loads, as a kernel would:
/// unlike the checked `read`, which refuses zero-page slots (they are not data), it reads
/// whatever is mapped readable.
///
/// # Safety
/// The span is mapped readable (pages or zero slots) and nothing unmaps it meanwhile.
pub unsafe fn read_host(addr: u64, len: usize) -> Vec<u8> {
    let mut out = vec![0u8; len];
    // SAFETY: by the caller's contract.
    unsafe { std::ptr::copy_nonoverlapping(addr as *const u8, out.as_mut_ptr(), len) };
    out
}
