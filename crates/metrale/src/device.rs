//! Which backend a model runs on: a [`Device`] as the user names it
//! (`--device cpu`), the knobs a backend takes ([`BackendOptions`]), and
//! [`open_backend`], the one place the facade and the CLI make a backend.

use std::fmt;
use std::str::FromStr;
use std::sync::Arc;

use anyhow::Result;
use metrale_gpu_runtime::cpu::{CpuBackend, OpTime};
use metrale_gpu_runtime::gpu::GpuBackend;

/// A backend to run on, as `--device` names it: `cpu` or `auto`.
///
/// Non-exhaustive: a build with the `cuda` feature will add `Cuda(ordinal)`
/// (`cuda` for ordinal 0, `cuda:N`); this build parses those into an error
/// that says so.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Device {
    /// The best backend this build has (today: the CPU).
    #[default]
    Auto,
    /// The CPU backend (every core unless told otherwise).
    Cpu,
}

impl Device {
    /// The names `--device` accepts in this build.
    pub const ACCEPTED: &'static [&'static str] = &["cpu", "auto"];

    /// The device `self` stands for: [`Device::Auto`] becomes the best
    /// backend this build has; any other device is itself.
    pub fn resolve(self) -> Device {
        match self {
            Device::Auto => Device::Cpu,
            other => other,
        }
    }
}

/// The name `--device` takes for it: `cpu`, `auto`.
impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Device::Auto => "auto",
            Device::Cpu => "cpu",
        })
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
        }
    }
}

impl std::error::Error for ParseDeviceError {}

impl FromStr for Device {
    type Err = ParseDeviceError;

    /// `cpu` or `auto`, in any case. `cuda` and `cuda:N` are refused with an
    /// error saying this build has no CUDA backend.
    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let name = text.trim().to_ascii_lowercase();
        let kind = match name.as_str() {
            "cpu" => return Ok(Device::Cpu),
            "auto" => return Ok(Device::Auto),
            "cuda" => ParseDeviceErrorKind::NotBuilt,
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
/// ignored by it (today every one applies to the CPU backend).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct BackendOptions {
    /// CPU worker threads (0: one per core; at most 4 per core).
    pub threads: usize,
    /// The most bytes the backend may hold (None: what the host has).
    pub memory_limit: Option<usize>,
    /// Let prefill matmuls with bf16 weights round the activations to bf16
    /// and use bf16 dot products where the hardware has them (the CPU:
    /// AVX512-BF16); the logits then move off the f32 reference by more
    /// than 1e-4. Off: f32 arithmetic throughout.
    pub bf16_dot_products: bool,
    /// Record the wall time of every op call, read with
    /// [`Backend::take_op_times`].
    pub op_profile: bool,
}

/// An opened backend: the [`GpuBackend`] models run on, the device it is,
/// and what the facade can ask of it beyond the trait.
#[derive(Clone)]
pub struct Backend {
    device: Device,
    gpu: Arc<dyn GpuBackend>,
    /// The same backend when it is the CPU's (threads, bf16, op profile).
    cpu: Option<Arc<CpuBackend>>,
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

    /// Per-op call counts and wall times since the last call, largest first
    /// (empty unless [`BackendOptions::op_profile`] was on); None on a
    /// backend that cannot profile its ops.
    pub fn take_op_times(&self) -> Option<Vec<OpTime>> {
        self.cpu.as_ref().map(|cpu| cpu.take_op_times())
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

/// Opens the backend `device` names ([`Device::Auto`]: the best this build
/// has), with `options`. Logs the device chosen at the info level.
pub fn open_backend(device: Device, options: &BackendOptions) -> Result<Backend> {
    let backend = match device {
        Device::Auto | Device::Cpu => open_cpu(options)?,
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
    let mut cpu = CpuBackend::try_with_threads(options.threads)?
        .with_bf16_dot_products(options.bf16_dot_products)
        .with_op_profile(options.op_profile);
    if let Some(limit) = options.memory_limit {
        cpu = cpu.with_memory_limit(limit);
    }
    let cpu = Arc::new(cpu);
    Ok(Backend {
        device: Device::Cpu,
        gpu: cpu.clone(),
        cpu: Some(cpu),
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
        assert_eq!(Device::Auto.resolve(), Device::Cpu);
        assert_eq!(Device::Cpu.resolve(), Device::Cpu);
    }

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
            assert!(text.contains("accepted: cpu, auto"), "{text}");
        }
    }

    #[test]
    fn opens_the_cpu_backend_with_its_options() {
        let options = BackendOptions {
            threads: 1,
            memory_limit: Some(1 << 20),
            op_profile: true,
            ..BackendOptions::default()
        };
        for device in [Device::Cpu, Device::Auto] {
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
