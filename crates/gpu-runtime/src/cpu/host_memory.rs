//! How much host memory this process can still take: the lower of the
//! kernel's `MemAvailable` and what the process's cgroup (v2 or v1) leaves
//! under its limit. Read once per question from /proc and /sys; elsewhere
//! than Linux nothing is known.

use std::path::{Path, PathBuf};

/// Bytes this process can still allocate, when the system says.
pub fn available() -> Option<usize> {
    let meminfo = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|t| mem_available(&t));
    let cgroup = std::fs::read_to_string("/proc/self/cgroup")
        .ok()
        .and_then(|t| cgroup_headroom(&t, Path::new("/sys/fs/cgroup")));
    match (meminfo, cgroup) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

/// `MemAvailable` of /proc/meminfo, in bytes.
fn mem_available(meminfo: &str) -> Option<usize> {
    let line = meminfo.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: usize = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

/// The cgroup's limit less its usage, from /proc/self/cgroup's `cgroup`
/// text and the cgroup file system mounted at `root`; None when unlimited
/// or unknown.
fn cgroup_headroom(cgroup: &str, root: &Path) -> Option<usize> {
    // (limit file, usage file) candidates: the process's own group, then the
    // mount's root (a container sees its group there).
    let mut candidates: Vec<(PathBuf, PathBuf)> = Vec::new();
    for line in cgroup.lines() {
        let mut parts = line.splitn(3, ':');
        let (_, controllers, path) = (parts.next()?, parts.next()?, parts.next()?);
        let path = path.trim_start_matches('/');
        if controllers.is_empty() {
            for dir in [root.join(path), root.to_path_buf()] {
                candidates.push((dir.join("memory.max"), dir.join("memory.current")));
            }
        } else if controllers.split(',').any(|c| c == "memory") {
            let mount = root.join("memory");
            for dir in [mount.join(path), mount.clone()] {
                candidates.push((
                    dir.join("memory.limit_in_bytes"),
                    dir.join("memory.usage_in_bytes"),
                ));
            }
        }
    }
    let read = |p: &Path| -> Option<usize> { std::fs::read_to_string(p).ok()?.trim().parse().ok() };
    candidates.iter().find_map(|(limit, usage)| {
        let limit = read(limit)?;
        // "max" (v2) does not parse; v1 writes a huge page-rounded number.
        if limit >= 1 << 60 {
            return None;
        }
        Some(limit.saturating_sub(read(usage).unwrap_or(0)))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn meminfo_is_read_in_bytes() {
        let text = "MemTotal:       24684084 kB\nMemFree:   1 kB\nMemAvailable:   2048 kB\n";
        assert_eq!(mem_available(text), Some(2048 * 1024));
        assert_eq!(mem_available("MemTotal: 1 kB\n"), None);
    }

    #[test]
    fn cgroup_limits_v1_and_v2() {
        let root = std::env::temp_dir().join(format!("metrale-cgroup-{}", std::process::id()));
        let v2 = root.join("v2");
        std::fs::create_dir_all(v2.join("app")).unwrap();
        std::fs::write(v2.join("app/memory.max"), "1000000\n").unwrap();
        std::fs::write(v2.join("app/memory.current"), "250000\n").unwrap();
        assert_eq!(cgroup_headroom("0::/app\n", &v2), Some(750_000));
        std::fs::write(v2.join("app/memory.max"), "max\n").unwrap();
        assert_eq!(cgroup_headroom("0::/app\n", &v2), None);

        let v1 = root.join("v1");
        std::fs::create_dir_all(v1.join("memory")).unwrap();
        std::fs::write(v1.join("memory/memory.limit_in_bytes"), "4000\n").unwrap();
        std::fs::write(v1.join("memory/memory.usage_in_bytes"), "1000\n").unwrap();
        // The group's own folder is not visible: the mount's root is used.
        let text = "4:memory:/process_api/abc\n0::/\n";
        assert_eq!(cgroup_headroom(text, &v1), Some(3000));
        std::fs::write(
            v1.join("memory/memory.limit_in_bytes"),
            "9223372036854771712\n",
        )
        .unwrap();
        assert_eq!(cgroup_headroom(text, &v1), None);
        std::fs::remove_dir_all(&root).ok();
    }
}
