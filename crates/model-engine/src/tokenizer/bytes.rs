//! The bytes a vocabulary entry's name stands for, in the two spellings
//! tokenizers use for raw bytes: byte-level BPE's alphabet (GPT-2's
//! `bytes_to_unicode`: `Ġ` is a space) and SentencePiece's byte fallback
//! (`<0x0A>`). The server reports a token's bytes with them, and the
//! structured-output engine builds its token trie with them.

/// The byte a character of byte-level BPE's alphabet stands for:
/// printable Latin-1 bytes as themselves, the 68 others as U+0100 on, in
/// byte order (0x00-0x20, 0x7F-0xA0, 0xAD). `None` off the alphabet.
pub fn byte_level_byte(c: char) -> Option<u8> {
    let c = c as u32;
    if c < 256 {
        let printable = matches!(c, 33..=126 | 161..=172 | 174..=255);
        return printable.then_some(c as u8);
    }
    match c - 256 {
        n @ 0..=32 => Some(n as u8),
        n @ 33..=66 => Some((127 + n - 33) as u8),
        67 => Some(0xAD),
        _ => None,
    }
}

/// `<0xAB>` as the byte 0xAB.
pub fn fallback_byte(name: &str) -> Option<u8> {
    let hex = name.strip_prefix("<0x")?.strip_suffix('>')?;
    (hex.len() == 2).then(|| u8::from_str_radix(hex, 16).ok())?
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_level_table() {
        assert_eq!(byte_level_byte('A'), Some(b'A'));
        assert_eq!(byte_level_byte('\u{120}'), Some(b' '), "Ġ");
        assert_eq!(byte_level_byte('\u{10A}'), Some(b'\n'), "Ċ");
        assert_eq!(byte_level_byte('\u{100}'), Some(0));
        assert_eq!(byte_level_byte('\u{143}'), Some(0xAD), "the last one");
        assert_eq!(byte_level_byte('\u{144}'), None);
        assert_eq!(byte_level_byte(' '), None, "a space is not in the alphabet");
    }

    #[test]
    fn the_alphabet_covers_every_byte_once() {
        let mut seen = [false; 256];
        for c in (0..0x200).filter_map(char::from_u32) {
            if let Some(b) = byte_level_byte(c) {
                assert!(!seen[b as usize], "{c:?}");
                seen[b as usize] = true;
            }
        }
        assert!(seen.iter().all(|&s| s));
    }
}
