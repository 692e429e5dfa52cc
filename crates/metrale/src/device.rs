//! Which backend a model runs on: a [`Device`] as the user names it
//! (`--device cpu`, `--device cuda:1`), the knobs a backend takes
//! ([`BackendOptions`]), and [`open_backend`], the one place the facade and
//! the CLI make a backend.

use std::fmt;
use std::str::FromStr;
use std::sync::Arc;

use anyhow::{Result, bail};
use metrale_gpu_runtime::cpu::{Bf16Kernel, CpuBackend, OpTime};
#[cfg(feature = "cuda")]
use metrale_gpu_runtime::cuda::CudaBackend;
use metrale_gpu_runtime::gpu::GpuBackend;

/// A backend to run on, as `--device` names it: `cpu`, `auto`, and in a
/// build with the `cuda` feature `cuda` (device 0) or `cuda:N`.
///
/// Non-exhaustive: `Cuda(ordinal)` exists only with the `cuda` feature; a
/// build without it parses `cuda` and `cuda:N` into an error that says so.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Device {
    /// The best backend this build has: with the `cuda` feature CUDA
    /// device 0 when it opens, else the CPU; without it the CPU.
    #[default]
    Auto,
    /// The CPU backend (every core unless told otherwise).
    Cpu,
    /// CUDA device `ordinal` (`cuda` is `cuda:0`).
    #[cfg(feature = "cuda")]
    Cuda(usize),
}

impl Device {
    /// The names `--device` accepts in this build.
    #[cfg(not(feature = "cuda"))]
    pub const ACCEPTED: &'static [&'static str] = &["cpu", "auto"];
    /// The names `--device` accepts in this build.
    #[cfg(feature = "cuda")]
    pub const ACCEPTED: &'static [&'static str] = &["cpu", "auto", "cuda", "cuda:N"];

    /// The device `self` stands for without opening anything: any device
    /// but [`Device::Auto`] is itself; `Auto` becomes the CPU in a build
    /// without the `cuda` feature and stays `Auto` in one with it (only
    /// [`open_backend`] can tell whether a GPU is there; ask the opened
    /// [`Backend::device`]).
    pub fn resolve(self) -> Device {
        match self {
            #[cfg(not(feature = "cuda"))]
            Device::Auto => Device::Cpu,
            other => other,
        }
    }
}

/// The name `--device` takes for it: `cpu`, `auto`, `cuda:N`.
impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Device::Auto => f.write_str("auto"),
            Device::Cpu => f.write_str("cpu"),
            #[cfg(feature = "cuda")]
            Device::Cuda(ordinal) => write!(f, "cuda:{ordinal}"),
        }
    }
}

/// Why a device name was refused.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParseDeviceError {
    text: String,
    kind: ParseDeviceErrorKind,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum ParseDeviceErrorKind {
    /// A device this build has no backend for (`cuda`, `cuda:N`).
    NotBuilt,
    /// `cuda:` followed by something that is not a device ordinal.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    BadOrdinal,
    /// Not a device name at all.
    Unknown,
}

impl ParseDeviceError {
    /// Whether the name is a real device this build has no backend for
    /// (`cuda` without the `cuda` feature), rather than an unknown name.
    pub fn is_not_built(&self) -> bool {
        self.kind == ParseDeviceErrorKind::NotBuilt
    }
}

impl fmt::Display for ParseDeviceError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let accepted = Device::ACCEPTED.join(", ");
        match self.kind {
            ParseDeviceErrorKind::NotBuilt => write!(
                f,
                "metrale was built without CUDA support; the CUDA backend arrives with the \
                 `cuda` feature (this build accepts: {accepted})"
            ),
            ParseDeviceErrorKind::Unknown => {
                write!(f, "unknown device {:?} (accepted: {accepted})", self.text)
            }
            ParseDeviceErrorKind::BadOrdinal => write!(
                f,
                "bad CUDA device {:?}: write cuda:N with N a device number such as 0 \
                 (accepted: {accepted})",
                self.text
            ),
        }
    }
}

impl std::error::Error for ParseDeviceError {}

impl FromStr for Device {
    type Err = ParseDeviceError;

    /// `cpu`, `auto`, `cuda` or `cuda:N`, in any case. Without the `cuda`
    /// feature, `cuda` and `cuda:N` are refused with an error saying this
    /// build has no CUDA backend.
    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let name = text.trim().to_ascii_lowercase();
        let kind = match name.as_str() {
            "cpu" => return Ok(Device::Cpu),
            "auto" => return Ok(Device::Auto),
            #[cfg(feature = "cuda")]
            "cuda" => return Ok(Device::Cuda(0)),
            #[cfg(feature = "cuda")]
            n if n.starts_with("cuda:") => match n["cuda:".len()..].parse::<usize>() {
                Ok(ordinal) if !n["cuda:".len()..].starts_with('+') => {
                    return Ok(Device::Cuda(ordinal));
                }
                _ => ParseDeviceErrorKind::BadOrdinal,
            },
            #[cfg(not(feature = "cuda"))]
            "cuda" => ParseDeviceErrorKind::NotBuilt,
            #[cfg(not(feature = "cuda"))]
            n if n.starts_with("cuda:") => ParseDeviceErrorKind::NotBuilt,
            _ => ParseDeviceErrorKind::Unknown,
        };
        Err(ParseDeviceError {
            text: text.to_string(),
            kind,
        })
    }
}

/// What a backend is opened with. Knobs a backend does not have are
/// ignored by it (the CUDA backend takes only `memory_limit`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct BackendOptions {
    /// CPU worker threads (0: one per core; at most 4 per core).
    pub threads: usize,
    /// The most bytes the backend may hold (None: what the host has).
    pub memory_limit: Option<usize>,
    /// Let matmuls with bf16 weights take the CPU's bf16 kernel where the
    /// hardware has one (AVX512-BF16): bf16 dot products on activations
    /// rounded to bf16, or f32 FMAs on the widened weights where those are
    /// the faster (Intel's cores; `Backend::bf16_kernel` says which); the
    /// logits then move off the f32 reference by more than 1e-4. Off: f32
    /// arithmetic throughout.
    pub bf16_dot_products: bool,
    /// Hold the SSM and delta-rule states in bf16 (the CPU's
    /// `with_bf16_ssm_state`): half their memory and decode traffic, the
    /// logits off the f32 state's by up to a few 1e-3. The CUDA backend
    /// keeps f32 states and says so in the log.
    pub bf16_ssm_state: bool,
    /// Record the wall time of every op call, read with
    /// [`Backend::take_op_times`].
    pub op_profile: bool,
    /// The CPU's bf16 kernel, forced (`bench --cpu-kernel`); None: what
    /// [`CPU_KERNEL_ENV`] names, else the fastest this CPU runs. Opening
    /// fails when this CPU does not run the kernel.
    pub cpu_kernel: Option<Bf16Kernel>,
}

/// The environment variable that forces the CPU's bf16 matmul kernel:
/// `amx` (Intel AMX tiles), `dot` (AVX512-BF16 dot products, what a Zen 4
/// host runs) or `fma` (f32 FMAs on the widened weights). Read when a CPU
/// backend opens; a name that is none of these, or a kernel this CPU does
/// not run, fails the open. It changes nothing under f32 arithmetic.
pub const CPU_KERNEL_ENV: &str = "METRALE_CPU_KERNEL";

/// A kernel's name (`amx`, `dot` or `fma`), as [`CPU_KERNEL_ENV`] and
/// `bench --cpu-kernel` take it.
pub fn parse_cpu_kernel(name: &str) -> std::result::Result<Bf16Kernel, String> {
    Bf16Kernel::from_name(name)
        .ok_or_else(|| format!("unknown CPU kernel {name:?} (use amx, dot or fma)"))
}

/// The kernel `options` force, else the one [`CPU_KERNEL_ENV`] names;
/// refused where this CPU does not run it.
fn forced_cpu_kernel(options: &BackendOptions) -> Result<Option<Bf16Kernel>> {
    let kernel = match options.cpu_kernel {
        Some(kernel) => Some(kernel),
        None => match std::env::var(CPU_KERNEL_ENV) {
            Ok(name) if !name.trim().is_empty() => Some(
                parse_cpu_kernel(&name).map_err(|e| anyhow::anyhow!("{CPU_KERNEL_ENV}: {e}"))?,
            ),
            _ => None,
        },
    };
    if let Some(kernel) = kernel
        && !kernel.runs_here()
    {
        let runs: Vec<&str> = Bf16Kernel::available_here()
            .into_iter()
            .map(|k| k.name())
            .collect();
        bail!(
            "the CPU kernel {} ({}) does not run on this CPU; it runs: {}",
            kernel.name(),
            kernel.describe(),
            if runs.is_empty() {
                "none (no AVX512-BF16)".to_string()
            } else {
                runs.join(", ")
            }
        );
    }
    Ok(kernel)
}

/// An opened backend: the [`GpuBackend`] models run on, the device it is,
/// and what the facade can ask of it beyond the trait.
#[derive(Clone)]
pub struct Backend {
    device: Device,
    gpu: Arc<dyn GpuBackend>,
    /// The same backend when it is the CPU's (threads, bf16, op profile).
    cpu: Option<Arc<CpuBackend>>,
    /// The same backend when it is a CUDA device's (name, memory, probe).
    #[cfg(feature = "cuda")]
    cuda: Option<Arc<CudaBackend>>,
}

/// What a device is, for reports (`metrale bench`, `inspect --memory`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceInfo {
    /// The device's name, e.g. "NVIDIA H200".
    pub name: String,
    /// CUDA compute capability, e.g. (9, 0).
    pub compute_capability: (i32, i32),
    /// Free device memory when asked, bytes.
    pub free_memory: usize,
    /// Total device memory, bytes.
    pub total_memory: usize,
    /// The driver's CUDA version, e.g. 13000 for 13.0.
    pub driver_version: i32,
    /// The backend's own scratch memory (outside the ledger), bytes.
    pub scratch_bytes: usize,
}

impl Backend {
    /// The device it runs on (never [`Device::Auto`]).
    pub fn device(&self) -> Device {
        self.device
    }

    /// The backend, for [`crate::Model::load_on`] and the engine crates.
    pub fn gpu(&self) -> &Arc<dyn GpuBackend> {
        &self.gpu
    }

    /// Host worker threads its ops run on (None: a backend whose ops do not
    /// run on host threads).
    pub fn threads(&self) -> Option<usize> {
        self.cpu.as_ref().map(|cpu| cpu.threads())
    }

    /// Whether prefill uses bf16 dot products: asked for in
    /// [`BackendOptions::bf16_dot_products`] and the hardware has them.
    pub fn bf16_dot_products(&self) -> bool {
        self.cpu.as_ref().is_some_and(|cpu| cpu.bf16_dot_products())
    }

    /// Which bf16 kernel the CPU's matmuls with bf16 weights take (None
    /// where bf16 arithmetic is off or the backend is not the CPU).
    pub fn bf16_kernel(&self) -> Option<Bf16Kernel> {
        self.cpu.as_ref().and_then(|cpu| cpu.bf16_kernel())
    }

    /// Whether the CPU's products of quantized weights take AMX-INT8 tiles
    /// for prefill and batched steps (false off the CPU, without AMX, or
    /// with a bf16 kernel other than AMX forced).
    pub fn int8_tiles(&self) -> bool {
        self.cpu.as_ref().is_some_and(|cpu| cpu.int8_tiles())
    }

    /// Per-op call counts and wall times since the last call, largest first
    /// (empty unless [`BackendOptions::op_profile`] was on); None on a
    /// backend that cannot profile its ops.
    pub fn take_op_times(&self) -> Option<Vec<OpTime>> {
        self.cpu.as_ref().map(|cpu| cpu.take_op_times())
    }

    /// The accelerator it is (name, compute capability, memory); None on
    /// the CPU.
    pub fn device_info(&self) -> Option<DeviceInfo> {
        #[cfg(feature = "cuda")]
        if let Some(cuda) = &self.cuda {
            let (free_memory, total_memory) = cuda.memory_info().unwrap_or((0, 0));
            return Some(DeviceInfo {
                name: cuda.device_name().to_string(),
                compute_capability: cuda.compute_capability(),
                free_memory,
                total_memory,
                driver_version: cuda.driver_version(),
                scratch_bytes: cuda.scratch_bytes(),
            });
        }
        None
    }

    /// The device memory bandwidth in bytes/s, measured now (a timed 1 GiB
    /// device-to-device copy, read and write counted); None on the CPU,
    /// whose bandwidth `metrale bench` measures on the host.
    pub fn device_bandwidth(&self) -> Option<Result<f64>> {
        #[cfg(feature = "cuda")]
        if let Some(cuda) = &self.cuda {
            return Some(cuda.bandwidth_probe().map_err(anyhow::Error::from));
        }
        None
    }
}

impl fmt::Debug for Backend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Backend")
            .field("device", &self.device)
            .field("threads", &self.threads())
            .finish_non_exhaustive()
    }
}

/// Whether `open_backend` says on stderr which device `--device auto`
/// chose (with the `cuda` feature). On by default; a quiet program turns it
/// off with [`announce_device_choice`].
static ANNOUNCE: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(true);

/// Turns the one stderr line saying which device `auto` chose on or off.
pub fn announce_device_choice(on: bool) {
    ANNOUNCE.store(on, std::sync::atomic::Ordering::Relaxed);
}

/// Opens the backend `device` names ([`Device::Auto`]: the best this build
/// has), with `options`. Logs the device chosen at the info level; in a
/// build with the `cuda` feature, `auto` also says on stderr when it chose
/// a GPU (and why it fell back to the CPU at the info level, `-v`).
pub fn open_backend(device: Device, options: &BackendOptions) -> Result<Backend> {
    let backend = match device {
        Device::Cpu => open_cpu(options)?,
        #[cfg(not(feature = "cuda"))]
        Device::Auto => open_cpu(options)?,
        #[cfg(feature = "cuda")]
        Device::Auto => {
            // Said once per process (a command may open its backend twice),
            // unless the program asked for quiet.
            static SAID: std::sync::Once = std::sync::Once::new();
            let say = |line: String| {
                if ANNOUNCE.load(std::sync::atomic::Ordering::Relaxed) {
                    SAID.call_once(|| eprintln!("{line}"));
                }
            };
            match open_cuda(0, options) {
                Ok(backend) => {
                    let name = backend.device_info().map(|i| i.name).unwrap_or_default();
                    say(format!(
                        "metrale: --device auto: running on cuda:0 ({name})"
                    ));
                    backend
                }
                Err(e) => {
                    // The normal case on most machines: said at -v, not
                    // on every run.
                    tracing::info!("--device auto: running on the CPU ({e:#})");
                    open_cpu(options)?
                }
            }
        }
        #[cfg(feature = "cuda")]
        Device::Cuda(ordinal) => open_cuda(ordinal, options)?,
    };
    match backend.threads() {
        Some(threads) => tracing::info!(
            "device {} (--device {device}), {threads} worker thread(s)",
            backend.device()
        ),
        None => tracing::info!("device {} (--device {device})", backend.device()),
    }
    Ok(backend)
}

fn open_cpu(options: &BackendOptions) -> Result<Backend> {
    let kernel = forced_cpu_kernel(options)?;
    let mut cpu = CpuBackend::try_with_threads(options.threads)?
        .with_bf16_dot_products(options.bf16_dot_products)
        .with_bf16_kernel(kernel)
        .with_bf16_ssm_state(options.bf16_ssm_state)
        .with_op_profile(options.op_profile);
    if let Some(limit) = options.memory_limit {
        cpu = cpu.with_memory_limit(limit);
    }
    let cpu = Arc::new(cpu);
    Ok(Backend {
        device: Device::Cpu,
        gpu: cpu.clone(),
        cpu: Some(cpu),
        #[cfg(feature = "cuda")]
        cuda: None,
    })
}

/// Opens CUDA device `ordinal`; the error says why it cannot (no driver
/// library, driver too old, no such device, the kernels do not load).
#[cfg(feature = "cuda")]
fn open_cuda(ordinal: usize, options: &BackendOptions) -> Result<Backend> {
    if options.bf16_ssm_state {
        // `--ssm-state-dtype auto` asks for bf16 under bf16 arithmetic, the
        // default: not worth a warning on every CUDA run.
        tracing::info!("the CUDA backend keeps SSM states in f32: bf16 states are the CPU's");
    }
    let cuda = CudaBackend::try_new(ordinal)
        .map_err(|e| anyhow::anyhow!("cannot open CUDA device {ordinal}: {e}"))?
        .with_memory_limit(options.memory_limit);
    let cuda = Arc::new(cuda);
    Ok(Backend {
        device: Device::Cuda(ordinal),
        gpu: cuda.clone(),
        cpu: None,
        cuda: Some(cuda),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_device_names() {
        assert_eq!("cpu".parse::<Device>(), Ok(Device::Cpu));
        assert_eq!("auto".parse::<Device>(), Ok(Device::Auto));
        assert_eq!(" CPU ".parse::<Device>(), Ok(Device::Cpu));
        assert_eq!("Auto".parse::<Device>(), Ok(Device::Auto));
        for name in ["cpu", "auto"] {
            assert_eq!(name.parse::<Device>().unwrap().to_string(), name);
        }
        assert_eq!(Device::default(), Device::Auto);
        #[cfg(not(feature = "cuda"))]
        assert_eq!(Device::Auto.resolve(), Device::Cpu);
        assert_eq!(Device::Cpu.resolve(), Device::Cpu);
    }

    #[cfg(not(feature = "cuda"))]
    #[test]
    fn cuda_is_refused_in_this_build() {
        for name in ["cuda", "cuda:0", "CUDA:3"] {
            let e = name.parse::<Device>().unwrap_err();
            assert!(e.is_not_built(), "{name}");
            let text = e.to_string();
            assert!(
                text.contains("metrale was built without CUDA support; the CUDA backend arrives with the `cuda` feature"),
                "{text}"
            );
            assert!(text.contains("cpu, auto"), "{text}");
        }
    }

    #[test]
    fn unknown_names_list_the_accepted_ones() {
        for name in ["tpu", "", "cpu0", "gpu"] {
            let e = name.parse::<Device>().unwrap_err();
            assert!(!e.is_not_built(), "{name}");
            let text = e.to_string();
            assert!(text.contains(&format!("{name:?}")), "{text}");
            assert!(
                text.contains(&format!("accepted: {}", Device::ACCEPTED.join(", "))),
                "{text}"
            );
        }
    }

    #[cfg(feature = "cuda")]
    #[test]
    fn parses_cuda_devices() {
        assert_eq!("cuda".parse::<Device>(), Ok(Device::Cuda(0)));
        assert_eq!("cuda:0".parse::<Device>(), Ok(Device::Cuda(0)));
        assert_eq!(" CUDA:3 ".parse::<Device>(), Ok(Device::Cuda(3)));
        assert_eq!("cuda:12".parse::<Device>(), Ok(Device::Cuda(12)));
        for name in ["cuda", "cuda:0", "cuda:7"] {
            let device = name.parse::<Device>().unwrap();
            assert_eq!(device.resolve(), device);
            let shown = device.to_string();
            assert!(shown.starts_with("cuda:"), "{shown}");
            assert_eq!(shown.parse::<Device>(), Ok(device));
        }
        assert_eq!(Device::Auto.resolve(), Device::Auto);
        for name in ["cuda:", "cuda:x", "cuda:-1", "cuda:+1", "cuda:1.0", "cuda0"] {
            let e = name.parse::<Device>().unwrap_err();
            assert!(!e.is_not_built(), "{name}");
            let text = e.to_string();
            assert!(text.contains(&format!("{name:?}")), "{text}");
            assert!(text.contains("cpu, auto, cuda, cuda:N"), "{text}");
        }
    }

    /// This machine has no GPU (CI): `cuda` fails with the reason and no
    /// panic; `auto` falls back to the CPU. On a machine with one, `cuda`
    /// opens it and reports what it is.
    #[cfg(feature = "cuda")]
    #[test]
    fn cuda_opens_or_says_why_and_auto_falls_back() {
        let options = BackendOptions::default();
        match open_backend(Device::Cuda(0), &options) {
            Ok(backend) => {
                assert_eq!(backend.device(), Device::Cuda(0));
                let info = backend
                    .device_info()
                    .expect("a CUDA device describes itself");
                assert!(!info.name.is_empty());
                assert!(info.total_memory > 0);
                assert_eq!(backend.threads(), None);
            }
            Err(e) => {
                let text = format!("{e:#}");
                assert!(text.contains("cannot open CUDA device 0"), "{text}");
                let auto = open_backend(Device::Auto, &options).unwrap();
                assert_eq!(auto.device(), Device::Cpu);
                assert!(auto.device_info().is_none());
                assert!(auto.device_bandwidth().is_none());
            }
        }
        let e = open_backend(Device::Cuda(4096), &options).unwrap_err();
        assert!(
            format!("{e:#}").contains("cannot open CUDA device 4096"),
            "{e:#}"
        );
    }

    #[test]
    fn opens_the_cpu_backend_with_its_options() {
        let options = BackendOptions {
            threads: 1,
            memory_limit: Some(1 << 20),
            op_profile: true,
            ..BackendOptions::default()
        };
        // With the `cuda` feature, `auto` is a GPU where there is one.
        let devices: &[Device] = if cfg!(feature = "cuda") {
            &[Device::Cpu]
        } else {
            &[Device::Cpu, Device::Auto]
        };
        for &device in devices {
            let backend = open_backend(device, &options).unwrap();
            assert_eq!(backend.device(), Device::Cpu);
            assert_eq!(backend.gpu().name(), "cpu");
            assert_eq!(backend.threads(), Some(1));
            assert!(!backend.bf16_dot_products());
            assert_eq!(backend.take_op_times(), Some(Vec::new()));
            let room = backend.gpu().available_memory();
            assert!(room.is_some_and(|b| b <= 1 << 20), "{room:?}");
        }
    }
}
