//! The host side of the dense kernels' launches, as free functions: each
//! checks an op's operands (dtypes, lengths, shapes) exactly as far as the
//! host can see them, and returns the launch's grid and kernel arguments,
//! or `None` when there is nothing to do. Nothing here touches the device,
//! so the checks are tested without one. Errors are the CPU backend's:
//! [`GpuError::Shape`] for lengths and shapes, [`GpuError::UnsupportedDType`]
//! for element types.
//!
//! What only the device sees (token ids, rows, slots, block ids) cannot be
//! checked here; the kernels skip out-of-range ones instead of faulting
//! (see `kernels/dense.cu`).

// Launch argument tuples mirror the kernels' parameter lists.
#![allow(clippy::type_complexity, clippy::too_many_arguments)]

use metrale_core::DType;

use super::launch::{LaunchCfg, Ptr};
use crate::error::{GpuError, Result};
use crate::gpu::DeviceSlice;
use crate::ops::RopeParams;

/// Threads per block of the elementwise kernels.
pub(super) const THREADS: u32 = 256;
/// Grid-stride kernels use at most this many blocks.
const MAX_BLOCKS: usize = 1 << 20;

/// A launch: its shape and its kernel's arguments.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) struct Launch<A> {
    pub cfg: LaunchCfg,
    pub args: A,
}

pub(super) fn shape_err(op: &'static str, detail: String) -> GpuError {
    GpuError::Shape { op, detail }
}

/// `s` holds at least `n` elements.
pub(super) fn need(op: &'static str, s: DeviceSlice, n: usize, what: &str) -> Result<()> {
    if s.len() < n {
        return Err(shape_err(
            op,
            format!("{what} has {} elements, needs {n}", s.len()),
        ));
    }
    Ok(())
}

/// `s` is of `dtype`.
pub(super) fn expect(op: &'static str, s: DeviceSlice, dtype: DType) -> Result<()> {
    if s.dtype() != dtype {
        return Err(GpuError::UnsupportedDType {
            op,
            dtype: s.dtype(),
        });
    }
    Ok(())
}

/// `s` is f32 with at least `n` elements.
pub(super) fn f32s(op: &'static str, s: DeviceSlice, n: usize, what: &str) -> Result<()> {
    expect(op, s, DType::F32)?;
    need(op, s, n, what)
}

/// The kernels' code of a weight dtype (`DT_*` of `kernels/common.cuh`).
pub(super) fn weight_code(op: &'static str, dtype: DType) -> Result<i32> {
    match dtype {
        DType::F32 => Ok(0),
        DType::BF16 => Ok(1),
        DType::F16 => Ok(2),
        dtype => Err(GpuError::UnsupportedDType { op, dtype }),
    }
}

/// `v` as a kernel's `int`.
pub(super) fn int(op: &'static str, v: usize, what: &str) -> Result<i32> {
    i32::try_from(v).map_err(|_| shape_err(op, format!("{what} = {v} exceeds a 32-bit int")))
}

/// A grid-stride launch over `n` elements (`n > 0`).
pub(super) fn elements(n: usize) -> LaunchCfg {
    LaunchCfg::linear(
        n.div_ceil(THREADS as usize).clamp(1, MAX_BLOCKS) as u32,
        THREADS,
    )
}

pub(super) fn embedding(
    table: DeviceSlice,
    ids: DeviceSlice,
    hidden: usize,
    out: DeviceSlice,
) -> Result<Option<Launch<(Ptr, Ptr, Ptr, i32, i32, i64, i32)>>> {
    const OP: &str = "embedding";
    expect(OP, ids, DType::U32)?;
    let dtype = weight_code(OP, table.dtype())?;
    let n = ids.len();
    f32s(OP, out, n * hidden, "out")?;
    if n == 0 || hidden == 0 {
        return Ok(None);
    }
    let vocab = (table.len() / hidden) as i64;
    Ok(Some(Launch {
        cfg: elements(n * hidden),
        args: (
            Ptr::of(table),
            Ptr::of(ids),
            Ptr::of(out),
            int(OP, n, "ids")?,
            int(OP, hidden, "hidden")?,
            vocab,
            dtype,
        ),
    }))
}

/// The matmul operands' checks; `Some(bias dtype code)` with a bias.
pub(super) fn matmul(
    op: &'static str,
    x: DeviceSlice,
    ws: &[(DeviceSlice, &str)],
    bias: Option<DeviceSlice>,
    out: DeviceSlice,
    m: usize,
    n: usize,
    k: usize,
) -> Result<Option<i32>> {
    f32s(op, x, m * k, "x")?;
    for &(w, what) in ws {
        weight_code(op, w.dtype())?;
        need(op, w, n * k, what)?;
    }
    f32s(op, out, m * n, "out")?;
    bias.map(|b| {
        need(op, b, n, "bias")?;
        weight_code(op, b.dtype())
    })
    .transpose()
}

pub(super) fn bias_add(
    out: DeviceSlice,
    bias: DeviceSlice,
    code: i32,
    m: usize,
    n: usize,
) -> Result<Launch<(Ptr, Ptr, i32, i32, i32)>> {
    const OP: &str = "matmul";
    Ok(Launch {
        cfg: elements(m * n),
        args: (
            Ptr::of(out),
            Ptr::of(bias),
            int(OP, m, "m")?,
            int(OP, n, "n")?,
            code,
        ),
    })
}

pub(super) fn rms_norm(
    x: DeviceSlice,
    w: DeviceSlice,
    out: DeviceSlice,
    rows: usize,
    dim: usize,
    eps: f32,
    offset: f32,
) -> Result<Option<Launch<(Ptr, Ptr, Ptr, i32, i32, f32, f32, i32)>>> {
    const OP: &str = "rms_norm";
    f32s(OP, x, rows * dim, "x")?;
    let code = weight_code(OP, w.dtype())?;
    need(OP, w, dim, "weight")?;
    f32s(OP, out, rows * dim, "out")?;
    if rows == 0 || dim == 0 {
        return Ok(None);
    }
    // About four elements a thread, 32 to 1024 threads.
    let threads = dim.div_ceil(4).next_multiple_of(32).clamp(32, 1024) as u32;
    Ok(Some(Launch {
        cfg: LaunchCfg::linear(
            u32::try_from(rows).map_err(|_| shape_err(OP, format!("{rows} rows")))?,
            threads,
        ),
        args: (
            Ptr::of(x),
            Ptr::of(w),
            Ptr::of(out),
            int(OP, rows, "rows")?,
            int(OP, dim, "dim")?,
            eps,
            offset,
            code,
        ),
    }))
}

pub(super) fn rope(
    x: DeviceSlice,
    positions: DeviceSlice,
    p: &RopeParams,
) -> Result<Option<Launch<(Ptr, Ptr, Ptr, i32, i32, i32, i32, f32)>>> {
    const OP: &str = "rope";
    expect(OP, positions, DType::U32)?;
    expect(OP, p.inv_freq, DType::F32)?;
    let half = p.rotary_dim / 2;
    if p.rotary_dim > p.head_dim || !p.rotary_dim.is_multiple_of(2) || p.inv_freq.len() < half {
        return Err(shape_err(
            OP,
            format!(
                "rotary_dim {} with head_dim {} and {} frequencies",
                p.rotary_dim,
                p.head_dim,
                p.inv_freq.len()
            ),
        ));
    }
    let rows = positions.len();
    f32s(OP, x, rows * p.n_heads * p.head_dim, "x")?;
    if rows == 0 || p.n_heads == 0 || half == 0 {
        return Ok(None);
    }
    Ok(Some(Launch {
        cfg: elements(rows * p.n_heads * half),
        args: (
            Ptr::of(x),
            Ptr::of(positions),
            Ptr::of(p.inv_freq),
            int(OP, rows, "rows")?,
            int(OP, p.n_heads, "n_heads")?,
            int(OP, p.head_dim, "head_dim")?,
            int(OP, p.rotary_dim, "rotary_dim")?,
            p.attention_scaling,
        ),
    }))
}

/// Elementwise ops over `n` f32 values: every operand is f32 and holds `n`.
pub(super) fn elementwise(
    op: &'static str,
    operands: &[(DeviceSlice, &str)],
    n: usize,
) -> Result<Option<i64>> {
    for &(s, what) in operands {
        f32s(op, s, n, what)?;
    }
    Ok((n > 0).then_some(n as i64))
}

pub(super) fn copy_cols(
    src: DeviceSlice,
    src_width: usize,
    col_start: usize,
    cols: usize,
    dst: DeviceSlice,
    rows: usize,
) -> Result<Option<Launch<(Ptr, Ptr, i32, i32, i32, i32)>>> {
    const OP: &str = "copy_cols";
    if col_start + cols > src_width {
        return Err(shape_err(
            OP,
            format!("columns {col_start}..{} of {src_width}", col_start + cols),
        ));
    }
    f32s(OP, src, rows * src_width, "src")?;
    f32s(OP, dst, rows * cols, "dst")?;
    if rows == 0 || cols == 0 {
        return Ok(None);
    }
    Ok(Some(Launch {
        cfg: elements(rows * cols),
        args: (
            Ptr::of(src),
            Ptr::of(dst),
            int(OP, rows, "rows")?,
            int(OP, src_width, "src_width")?,
            int(OP, col_start, "col_start")?,
            int(OP, cols, "cols")?,
        ),
    }))
}

pub(super) fn scatter_cols(
    src: DeviceSlice,
    cols: usize,
    dst: DeviceSlice,
    dst_width: usize,
    col_start: usize,
    rows: usize,
) -> Result<Option<Launch<(Ptr, Ptr, i32, i32, i32, i32)>>> {
    const OP: &str = "scatter_cols";
    if col_start + cols > dst_width {
        return Err(shape_err(
            OP,
            format!("columns {col_start}..{} of {dst_width}", col_start + cols),
        ));
    }
    f32s(OP, src, rows * cols, "src")?;
    f32s(OP, dst, rows * dst_width, "dst")?;
    if rows == 0 || cols == 0 {
        return Ok(None);
    }
    Ok(Some(Launch {
        cfg: elements(rows * cols),
        args: (
            Ptr::of(src),
            Ptr::of(dst),
            int(OP, rows, "rows")?,
            int(OP, cols, "cols")?,
            int(OP, dst_width, "dst_width")?,
            int(OP, col_start, "col_start")?,
        ),
    }))
}

pub(super) fn gather_rows(
    src: DeviceSlice,
    rows: DeviceSlice,
    width: usize,
    out: DeviceSlice,
) -> Result<Option<Launch<(Ptr, Ptr, Ptr, i32, i64, i64, i32)>>> {
    const OP: &str = "gather_rows";
    expect(OP, rows, DType::U32)?;
    if out.dtype() != src.dtype() {
        return Err(shape_err(
            OP,
            format!("{} rows gathered into {}", src.dtype(), out.dtype()),
        ));
    }
    let n = rows.len();
    need(OP, out, n * width, "out")?;
    if n == 0 || width == 0 {
        return Ok(None);
    }
    let row_bytes = width * src.dtype().size_of();
    // Whole rows are moved in the widest units their size and both
    // addresses allow.
    let unit = [4usize, 2, 1]
        .into_iter()
        .find(|&u| {
            row_bytes.is_multiple_of(u)
                && src.ptr().raw().is_multiple_of(u as u64)
                && out.ptr().raw().is_multiple_of(u as u64)
        })
        .unwrap_or(1);
    let row_units = row_bytes / unit;
    Ok(Some(Launch {
        cfg: elements(n * row_units),
        args: (
            Ptr::of(src),
            Ptr::of(rows),
            Ptr::of(out),
            int(OP, n, "rows")?,
            row_units as i64,
            (src.len() / width) as i64,
            unit as i32,
        ),
    }))
}

pub(super) fn scatter_add_rows(
    src: DeviceSlice,
    rows: DeviceSlice,
    weights: DeviceSlice,
    width: usize,
    dst: DeviceSlice,
) -> Result<Option<Launch<(Ptr, Ptr, Ptr, Ptr, i32, i32, i64)>>> {
    const OP: &str = "scatter_add_rows";
    expect(OP, rows, DType::U32)?;
    expect(OP, weights, DType::F32)?;
    let n = rows.len();
    if weights.len() < n {
        return Err(shape_err(
            OP,
            format!("{n} rows but {} weights", weights.len()),
        ));
    }
    f32s(OP, src, n * width, "src")?;
    expect(OP, dst, DType::F32)?;
    if n == 0 || width == 0 {
        return Ok(None);
    }
    // One thread per column; each walks the entries in order.
    Ok(Some(Launch {
        cfg: LaunchCfg::linear(width.div_ceil(128) as u32, 128),
        args: (
            Ptr::of(src),
            Ptr::of(rows),
            Ptr::of(weights),
            Ptr::of(dst),
            int(OP, n, "rows")?,
            int(OP, width, "width")?,
            (dst.len() / width) as i64,
        ),
    }))
}
