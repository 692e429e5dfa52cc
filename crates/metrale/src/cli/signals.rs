//! Removing a half-written file when the user ends the process: SIGINT
//! (Ctrl-C), SIGTERM (`kill`), SIGHUP (the terminal closed) and SIGQUIT
//! (Ctrl-\) remove it, then the process exits with status 128 + the
//! signal's number, the status a shell reports for a process that signal
//! ended. A signal ignored when the process started stays ignored: `nohup`
//! ignores SIGHUP, and a non-interactive shell starts background jobs with
//! SIGINT and SIGQUIT ignored.

use std::path::Path;

use anyhow::Result;

/// Removes `path` when a terminating signal ends the process (see the
/// module docs). A later call replaces the path.
#[cfg(unix)]
pub fn remove_on_signal(path: &Path) -> Result<()> {
    unix::install(path)
}

/// Removes `path` on Ctrl-C, exiting with status 130 (without Unix signals,
/// Ctrl-C is the one ctrlc reports).
#[cfg(not(unix))]
pub fn remove_on_signal(path: &Path) -> Result<()> {
    let path = path.to_path_buf();
    ctrlc::set_handler(move || {
        let _ = std::fs::remove_file(&path);
        std::process::exit(130);
    })?;
    Ok(())
}

#[cfg(unix)]
mod unix {
    use std::ffi::CString;
    use std::os::unix::ffi::OsStrExt;
    use std::path::Path;
    use std::sync::atomic::{AtomicPtr, Ordering};

    use anyhow::{Context, Result};

    /// The path to remove, for the handler: a C string that lives as long
    /// as the process (a handler may read it at any moment, so it is never
    /// freed).
    static PATH: AtomicPtr<libc::c_char> = AtomicPtr::new(std::ptr::null_mut());

    const SIGNALS: [(libc::c_int, &str); 4] = [
        (libc::SIGINT, "SIGINT"),
        (libc::SIGTERM, "SIGTERM"),
        (libc::SIGHUP, "SIGHUP"),
        (libc::SIGQUIT, "SIGQUIT"),
    ];

    pub fn install(path: &Path) -> Result<()> {
        let c = CString::new(path.as_os_str().as_bytes())
            .with_context(|| format!("{}: a path with a NUL byte", path.display()))?;
        PATH.store(c.into_raw(), Ordering::SeqCst);
        for (signal, name) in SIGNALS {
            // SAFETY: sigaction with zero-initialised structs (a valid
            // `sigaction` on every libc), and a handler that makes only
            // async-signal-safe calls.
            unsafe {
                let mut old: libc::sigaction = std::mem::zeroed();
                if libc::sigaction(signal, std::ptr::null(), &mut old) != 0 {
                    return Err(std::io::Error::last_os_error())
                        .with_context(|| format!("reading the action of {name}"));
                }
                if old.sa_sigaction == libc::SIG_IGN {
                    continue;
                }
                let mut action: libc::sigaction = std::mem::zeroed();
                action.sa_sigaction = on_signal as extern "C" fn(libc::c_int) as libc::sighandler_t;
                // The other signals wait while the handler runs.
                libc::sigfillset(&mut action.sa_mask);
                if libc::sigaction(signal, &action, std::ptr::null_mut()) != 0 {
                    return Err(std::io::Error::last_os_error())
                        .with_context(|| format!("handling {name}"));
                }
            }
        }
        Ok(())
    }

    /// The handler: in signal context, so nothing but `unlink` and `_exit`
    /// (no allocation, no locks, no destructors).
    extern "C" fn on_signal(signal: libc::c_int) {
        let path = PATH.load(Ordering::SeqCst);
        // SAFETY: `path` is null or a NUL-terminated string never freed.
        unsafe {
            if !path.is_null() {
                libc::unlink(path);
            }
            libc::_exit(128 + signal);
        }
    }
}
