//! The weight matrices `quant_matmul` multiplies: GGML's row-major blocks,
//! or the grouped layout ([`DType::QuantGroups`]) that decode's group
//! kernels read as one stream, made from them at load by [`group_rows`].
//!
//! [`DType::QuantGroups`]: metrale_core::DType::QuantGroups

use metrale_core::quant::QuantError;
use metrale_core::{GgmlType, QUANT_GROUP_ROWS as G};

use super::supports;
use crate::error::{GpuError, Result};

/// A `[n, k]` matrix of GGML blocks, row-major (rows `row_bytes` apart) or
/// grouped; checked once on construction so that the kernels index
/// without checks.
#[derive(Clone, Copy, Debug)]
pub struct QuantMatrix<'a> {
    ty: GgmlType,
    data: &'a [u8],
    n: usize,
    k: usize,
    row_bytes: usize,
    grouped: bool,
}

fn shape(detail: String) -> GpuError {
    GpuError::Shape {
        op: "quant_matmul",
        detail,
    }
}

/// Bytes of a row of `k` elements of `ty`, if `ty` is multiplied here and
/// `k` is whole blocks.
fn row_bytes(ty: GgmlType, k: usize) -> Result<usize> {
    if !supports(ty) {
        return Err(shape(format!("no quantized matmul for {ty} weights")));
    }
    ty.row_bytes(k).ok_or_else(|| {
        shape(
            QuantError::NotWholeBlocks {
                ty,
                elems: k,
                block: ty.block_elems(),
            }
            .to_string(),
        )
    })
}

impl<'a> QuantMatrix<'a> {
    /// `data` must be exactly `n` rows of `k` elements of a supported type,
    /// row-major.
    pub fn new(ty: GgmlType, data: &'a [u8], n: usize, k: usize) -> Result<Self> {
        Self::with_layout(ty, data, n, k, false)
    }

    /// `data` must be exactly `n` rows of `k` elements of a supported type,
    /// grouped (as [`group_rows`] leaves them).
    pub fn grouped(ty: GgmlType, data: &'a [u8], n: usize, k: usize) -> Result<Self> {
        Self::with_layout(ty, data, n, k, true)
    }

    fn with_layout(
        ty: GgmlType,
        data: &'a [u8],
        n: usize,
        k: usize,
        grouped: bool,
    ) -> Result<Self> {
        let row_bytes = row_bytes(ty, k)?;
        if Some(data.len()) != row_bytes.checked_mul(n) {
            return Err(shape(format!(
                "{n} rows of {k} {ty} elements take {n}x{row_bytes} bytes, got {}",
                data.len()
            )));
        }
        Ok(Self {
            ty,
            data,
            n,
            k,
            row_bytes,
            grouped,
        })
    }

    pub fn ty(&self) -> GgmlType {
        self.ty
    }

    pub fn rows(&self) -> usize {
        self.n
    }

    pub fn cols(&self) -> usize {
        self.k
    }

    /// Bytes of weights (what decode streams).
    pub fn bytes(&self) -> usize {
        self.data.len()
    }

    pub(super) fn is_grouped(&self) -> bool {
        self.grouped
    }

    /// Bytes between rows of the row-major layout.
    pub(super) fn row_bytes(&self) -> usize {
        self.row_bytes
    }

    /// Block `b` of row `j`, in either layout (no copy).
    pub(super) fn block(&self, j: usize, b: usize) -> &'a [u8] {
        let bb = self.ty.block_bytes();
        if !self.grouped {
            return &self.data[j * self.row_bytes + b * bb..][..bb];
        }
        let (group, w) = self.group(j / G);
        &group[block_at(w, j % G, b, bb)..][..bb]
    }

    /// The bytes that hold rows `j0..j0 + count`, in either layout (`j0`
    /// and `count` multiples of the group's rows when grouped): what to
    /// prefetch for them.
    pub(super) fn span_of_rows(&self, j0: usize, count: usize) -> &'a [u8] {
        let rb = self.row_bytes;
        &self.data[j0 * rb..((j0 + count) * rb).min(self.data.len())]
    }

    /// Rows `j0..j0 + count` as one run of row-major blocks; None when
    /// grouped.
    pub(super) fn row_run(&self, j0: usize, count: usize) -> Option<&'a [u8]> {
        let rb = self.row_bytes;
        (!self.grouped).then(|| &self.data[j0 * rb..(j0 + count) * rb])
    }

    /// Group `g`'s bytes (rows `G·g..`) and its row count, in the grouped
    /// layout.
    pub(super) fn group(&self, g: usize) -> (&'a [u8], usize) {
        let j0 = g * G;
        let w = G.min(self.n - j0);
        (
            &self.data[j0 * self.row_bytes..(j0 + w) * self.row_bytes],
            w,
        )
    }

    /// Row `j` as GGML blocks: borrowed when row-major, gathered into `buf`
    /// when grouped.
    pub(super) fn row_in<'s>(&'s self, j: usize, buf: &'s mut Vec<u8>) -> &'s [u8] {
        if !self.grouped {
            return &self.data[j * self.row_bytes..(j + 1) * self.row_bytes];
        }
        buf.resize(self.row_bytes, 0);
        let (group, w) = self.group(j / G);
        gather(group, w, j % G, self.ty.block_bytes(), buf);
        buf
    }

    /// Rows `j0..j0 + R` as GGML blocks: borrowed when row-major, gathered
    /// into `buf` when grouped.
    pub(super) fn rows_in<'s, const R: usize>(
        &'s self,
        j0: usize,
        buf: &'s mut Vec<u8>,
    ) -> [&'s [u8]; R] {
        let rb = self.row_bytes;
        if !self.grouped {
            return std::array::from_fn(|r| &self.data[(j0 + r) * rb..(j0 + r + 1) * rb]);
        }
        buf.resize(R * rb, 0);
        for (r, out) in buf.chunks_exact_mut(rb).enumerate() {
            let (group, w) = self.group((j0 + r) / G);
            gather(group, w, (j0 + r) % G, self.ty.block_bytes(), out);
        }
        let buf: &'s [u8] = buf;
        std::array::from_fn(|r| &buf[r * rb..(r + 1) * rb])
    }
}

/// Where block `b` of row `r` starts in a group of `w` rows (blocks of
/// `bb` bytes): the grouped layout's one formula.
fn block_at(w: usize, r: usize, b: usize, bb: usize) -> usize {
    (b * w + r) * bb
}

/// Row `r` of a group of `w` rows (grouped layout, blocks of `bb` bytes)
/// into `out` (one row's bytes).
fn gather(group: &[u8], w: usize, r: usize, bb: usize, out: &mut [u8]) {
    for (b, blk) in out.chunks_exact_mut(bb).enumerate() {
        blk.copy_from_slice(&group[block_at(w, r, b, bb)..][..bb]);
    }
}

/// Rewrites `data`, `n` row-major rows of `k` elements of `ty`, in place
/// into the grouped layout ([`DType::QuantGroups`]); one group's bytes are
/// copied aside at a time.
///
/// [`DType::QuantGroups`]: metrale_core::DType::QuantGroups
pub fn group_rows(ty: GgmlType, data: &mut [u8], n: usize, k: usize) -> Result<()> {
    let rb = row_bytes(ty, k)?;
    if Some(data.len()) != rb.checked_mul(n) {
        return Err(shape(format!(
            "{n} rows of {k} {ty} elements take {n}x{rb} bytes, got {}",
            data.len()
        )));
    }
    if rb == 0 {
        return Ok(()); // No columns: nothing to move.
    }
    let bb = ty.block_bytes();
    let mut rows = vec![0u8; G * rb];
    for group in data.chunks_mut(G * rb) {
        let w = group.len() / rb;
        rows[..group.len()].copy_from_slice(group);
        for (r, row) in rows[..group.len()].chunks_exact(rb).enumerate() {
            for (b, blk) in row.chunks_exact(bb).enumerate() {
                group[block_at(w, r, b, bb)..][..bb].copy_from_slice(blk);
            }
        }
    }
    Ok(())
}

/// Dequantizes row `j` of a grouped `[n, k]` matrix (`data`) into `out`
/// (`k` floats); NaN where the row is not inside `data`.
pub(crate) fn dequantize_grouped_row(ty: GgmlType, data: &[u8], j: usize, out: &mut [f32]) {
    let k = out.len();
    let bb = ty.block_bytes();
    let (be, rb) = (ty.block_elems(), ty.row_bytes(k));
    let done = rb.filter(|&rb| rb > 0).is_some_and(|rb| {
        let n = data.len() / rb;
        let g0 = j / G * G;
        j < n && {
            let w = G.min(n - g0);
            let group = &data[g0 * rb..(g0 + w) * rb];
            out.chunks_exact_mut(be).enumerate().all(|(b, o)| {
                let src = &group[block_at(w, j % G, b, bb)..][..bb];
                metrale_core::quant::dequantize_row(ty, src, o).is_ok()
            })
        }
    });
    if !done {
        out.fill(f32::NAN);
    }
}

impl super::super::CpuBackend {
    /// `pack_matmul_weight` for quantized weights: the matrix rewritten in
    /// place into the grouped layout and relabelled
    /// [`DType::QuantGroups`](metrale_core::DType::QuantGroups), where this
    /// CPU has a group kernel for its format; `None` (untouched) elsewhere.
    /// The products are the same bits either way.
    pub(in crate::cpu) fn group_quant_weight(
        &self,
        w: crate::gpu::DeviceSlice,
        q: metrale_core::QuantFormat,
        n: usize,
        k: usize,
    ) -> Result<Option<crate::gpu::DeviceSlice>> {
        const OP: &str = "pack_matmul_weight";
        if !super::groups_pay(q.ggml()) || n < G || Some(w.len()) != n.checked_mul(k) {
            return Ok(None);
        }
        let bytes = self.write(OP, w, &[])?;
        group_rows(q.ggml(), bytes, n, k)?;
        let grouped = metrale_core::DType::QuantGroups(q);
        Ok(Some(crate::gpu::DeviceSlice::new(
            w.ptr(),
            grouped,
            w.len(),
        )))
    }
}
