//! How an error reaches people: one line, the same from every binary.

/// An error for people: its messages from the outermost in, joined by
/// ": ", leaving out a cause whose text the message before it already
/// holds (a context that repeats its source). Never a backtrace.
pub fn format_error(error: &anyhow::Error) -> String {
    let mut out = String::new();
    let mut last = String::new();
    for cause in error.chain() {
        let text = cause.to_string();
        if text.is_empty() || last.contains(&text) {
            continue;
        }
        if !out.is_empty() {
            out.push_str(": ");
        }
        out.push_str(&text);
        last = text;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::format_error;
    use anyhow::Context;

    #[test]
    fn format_error_joins_the_chain_without_repeats() {
        let e = Err::<(), _>(std::io::Error::other("no such file x.json"))
            .context("reading x.json: no such file x.json")
            .context("loading model")
            .unwrap_err();
        assert_eq!(
            format_error(&e),
            "loading model: reading x.json: no such file x.json"
        );
        let e = anyhow::anyhow!("a").context("b");
        assert_eq!(format_error(&e), "b: a");
    }
}
