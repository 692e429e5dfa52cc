//! Names the build for `metrale --version`: the package version and, when
//! built from a git checkout, the commit (`METRALE_BUILD_VERSION`).

use std::process::Command;

fn git(args: &[&str]) -> Option<String> {
    let out = Command::new("git").args(args).output().ok()?;
    if !out.status.success() {
        return None;
    }
    let text = String::from_utf8(out.stdout).ok()?.trim().to_string();
    (!text.is_empty()).then_some(text)
}

fn main() {
    let version = env!("CARGO_PKG_VERSION");
    println!("cargo:rerun-if-env-changed=METRALE_GIT_COMMIT");
    let commit = std::env::var("METRALE_GIT_COMMIT")
        .ok()
        .filter(|c| !c.is_empty())
        .or_else(|| git(&["rev-parse", "--short=12", "HEAD"]));
    // Rebuild the name when HEAD moves (a checkout, or a commit on the branch).
    for path in [
        Some("HEAD".to_string()),
        git(&["symbolic-ref", "-q", "HEAD"]),
    ]
    .into_iter()
    .flatten()
    {
        if let Some(file) = git(&["rev-parse", "--git-path", &path]) {
            println!("cargo:rerun-if-changed={file}");
        }
    }
    let name = match commit {
        Some(commit) => format!("{version} (git {commit})"),
        None => version.to_string(),
    };
    println!("cargo:rustc-env=METRALE_BUILD_VERSION={name}");
}
