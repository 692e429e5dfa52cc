//! NVRTC, loaded at run time with `libloading` (no link-time CUDA dependency).

use std::ffi::{CStr, CString, c_char, c_int, c_void};
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use libloading::Library;

type Program = *mut c_void;
type Status = c_int;

/// A loaded `libnvrtc.so`.
pub struct Nvrtc {
    lib: Library,
    /// NVRTC's builtins library, loaded first from the same folder when it is
    /// there, so NVRTC finds it whatever the loader's search path.
    _builtins: Option<Library>,
    pub path: PathBuf,
}

/// A successful compilation.
pub struct Compiled {
    pub ptx: String,
    /// Warnings, if any.
    pub log: String,
}

impl Nvrtc {
    pub fn load(path: &Path) -> Result<Self> {
        let builtins = builtins_beside(path)
            .map(|b| {
                // SAFETY: loading NVIDIA's library runs only its initialisers.
                unsafe { Library::new(&b) }.with_context(|| format!("loading {}", b.display()))
            })
            .transpose()?;
        // SAFETY: as above.
        let lib = unsafe { Library::new(path) }
            .with_context(|| format!("loading NVRTC from {}", path.display()))?;
        Ok(Self {
            lib,
            _builtins: builtins,
            path: path.to_path_buf(),
        })
    }

    /// `(major, minor)` from `nvrtcVersion`.
    pub fn version(&self) -> Result<(i32, i32)> {
        let (mut major, mut minor) = (0, 0);
        // SAFETY: the documented signature; both pointers are valid.
        unsafe {
            let f = self
                .sym::<unsafe extern "C" fn(*mut c_int, *mut c_int) -> Status>(b"nvrtcVersion\0")?;
            self.check(f(&mut major, &mut minor), "nvrtcVersion")?;
        }
        Ok((major, minor))
    }

    /// Compiles `source`, named `name` in messages, to PTX. On a compile error
    /// the `Err` carries NVRTC's log.
    pub fn compile(&self, name: &str, source: &str, options: &[String]) -> Result<Compiled> {
        let c_src = CString::new(source).context("a NUL byte in the source")?;
        let c_name = CString::new(name)?;
        let c_opts: Vec<CString> = options
            .iter()
            .map(|o| CString::new(o.as_str()))
            .collect::<Result<_, _>>()?;
        let opt_ptrs: Vec<*const c_char> = c_opts.iter().map(|o| o.as_ptr()).collect();
        let mut prog: Program = std::ptr::null_mut();
        // SAFETY: NVRTC's documented C API; every pointer passed outlives the
        // call, the buffers are sized from NVRTC's own size queries, and the
        // program is destroyed on every path once created.
        unsafe {
            let create = self.sym::<unsafe extern "C" fn(
                *mut Program,
                *const c_char,
                *const c_char,
                c_int,
                *const *const c_char,
                *const *const c_char,
            ) -> Status>(b"nvrtcCreateProgram\0")?;
            let st = create(
                &mut prog,
                c_src.as_ptr(),
                c_name.as_ptr(),
                0,
                std::ptr::null(),
                std::ptr::null(),
            );
            self.check(st, "nvrtcCreateProgram")?;
            let result = self.compile_created(prog, &opt_ptrs);
            let destroy =
                self.sym::<unsafe extern "C" fn(*mut Program) -> Status>(b"nvrtcDestroyProgram\0")?;
            destroy(&mut prog);
            let (status, log, ptx) = result?;
            if status != 0 {
                bail!("{}\n{}", self.error_string(status), log.trim_end());
            }
            Ok(Compiled { ptx, log })
        }
    }

    /// Compiles a created program: (compile status, log, PTX).
    unsafe fn compile_created(
        &self,
        prog: Program,
        opts: &[*const c_char],
    ) -> Result<(Status, String, String)> {
        type Compile = unsafe extern "C" fn(Program, c_int, *const *const c_char) -> Status;
        type Size = unsafe extern "C" fn(Program, *mut usize) -> Status;
        type Get = unsafe extern "C" fn(Program, *mut c_char) -> Status;
        // SAFETY: the caller passes a live program; see `compile`.
        unsafe {
            let compile = self.sym::<Compile>(b"nvrtcCompileProgram\0")?;
            let status = compile(prog, opts.len() as c_int, opts.as_ptr());
            let log = self.read(
                prog,
                self.sym::<Size>(b"nvrtcGetProgramLogSize\0")?,
                self.sym::<Get>(b"nvrtcGetProgramLog\0")?,
            )?;
            if status != 0 {
                return Ok((status, log, String::new()));
            }
            let ptx = self.read(
                prog,
                self.sym::<Size>(b"nvrtcGetPTXSize\0")?,
                self.sym::<Get>(b"nvrtcGetPTX\0")?,
            )?;
            Ok((status, log, ptx))
        }
    }

    unsafe fn read(
        &self,
        prog: Program,
        size: unsafe extern "C" fn(Program, *mut usize) -> Status,
        get: unsafe extern "C" fn(Program, *mut c_char) -> Status,
    ) -> Result<String> {
        let mut n = 0usize;
        // SAFETY: a live program; the buffer has the size NVRTC asked for.
        unsafe {
            self.check(size(prog, &mut n), "nvrtcGet*Size")?;
            let mut buf = vec![0u8; n.max(1)];
            self.check(get(prog, buf.as_mut_ptr().cast()), "nvrtcGet*")?;
            let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
            buf.truncate(end);
            String::from_utf8(buf).context("NVRTC output is not UTF-8")
        }
    }

    unsafe fn sym<T: Copy>(&self, name: &[u8]) -> Result<T> {
        // SAFETY: the caller names the symbol's true type.
        unsafe {
            self.lib
                .get::<T>(name)
                .map(|s| *s)
                .with_context(|| format!("{} lacks {}", self.path.display(), show(name)))
        }
    }

    fn check(&self, status: Status, what: &str) -> Result<()> {
        if status != 0 {
            bail!("{what}: {}", self.error_string(status));
        }
        Ok(())
    }

    fn error_string(&self, status: Status) -> String {
        // SAFETY: nvrtcGetErrorString returns a static C string.
        unsafe {
            match self
                .sym::<unsafe extern "C" fn(Status) -> *const c_char>(b"nvrtcGetErrorString\0")
            {
                Ok(f) if !f(status).is_null() => CStr::from_ptr(f(status)).to_string_lossy().into(),
                _ => format!("NVRTC error {status}"),
            }
        }
    }
}

fn show(name: &[u8]) -> String {
    String::from_utf8_lossy(name.strip_suffix(b"\0").unwrap_or(name)).into_owned()
}

/// `libnvrtc-builtins.so*` in the folder of `lib`, if there is one.
fn builtins_beside(lib: &Path) -> Option<PathBuf> {
    let mut found: Vec<PathBuf> = std::fs::read_dir(lib.parent()?)
        .ok()?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("libnvrtc-builtins.so"))
        })
        .collect();
    found.sort();
    found.pop()
}
