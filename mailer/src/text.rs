//! The one cleaning function for text from outside the process (a relay's reply, a Mailgun error
//! message, an event's reason, a user's field) before a human sees it in a condition, an Event or
//! a log line.
//!
//! `kubectl describe` and terminals render what they are given: an ESC sequence recolours or
//! clears the screen, BEL rings, U+2028 breaks a line where the reader expects none, and a
//! bidirectional override (U+202E) shows `txt.exe` as `exe.txt`. [`clean`] makes such text
//! inert and bounded, on a character boundary.

/// What replaces a character that is neither printable nor whitespace.
pub const REPLACEMENT: char = '\u{FFFD}';

/// What [`clean`] replaces: C0 controls, DEL, C1 controls, the Unicode line and paragraph
/// separators, and the bidirectional marks, embeddings, overrides and isolates.
pub fn is_unsafe(c: char) -> bool {
    matches!(c,
        '\u{0}'..='\u{1F}'
        | '\u{7F}'..='\u{9F}'
        | '\u{2028}' | '\u{2029}'
        | '\u{061C}' | '\u{200E}' | '\u{200F}'
        | '\u{202A}'..='\u{202E}'
        | '\u{2066}'..='\u{2069}')
}

/// Line breaks and tabs: they become one space, so the text stays on one line.
fn is_break(c: char) -> bool {
    matches!(
        c,
        '\t' | '\n' | '\u{B}' | '\u{C}' | '\r' | '\u{85}' | '\u{2028}' | '\u{2029}'
    )
}

/// `text` made safe to show: every [`is_unsafe`] character replaced (line breaks and tabs by one
/// space, runs of spaces folded, the others by U+FFFD), trimmed, and cut on a character boundary
/// to at most `max_bytes` bytes of UTF-8 (ending in `…` when cut and there is room for it).
/// Bytes, not characters, because that is how the API server bounds fields (an Event's note:
/// 1 KiB). Idempotent.
pub fn clean(text: &str, max_bytes: usize) -> String {
    const ELLIPSIS: char = '…';
    let mut out = String::with_capacity(text.len().min(max_bytes));
    let mut pending_space = false;
    let mut cut = false;
    for c in text.chars() {
        let c = if is_break(c) || c == ' ' {
            pending_space = !out.is_empty();
            continue;
        } else if is_unsafe(c) {
            REPLACEMENT
        } else {
            c
        };
        let needed = usize::from(pending_space) + c.len_utf8();
        if out.len() + needed > max_bytes {
            cut = true;
            break;
        }
        if pending_space {
            out.push(' ');
            pending_space = false;
        }
        out.push(c);
    }
    if cut && max_bytes >= ELLIPSIS.len_utf8() {
        while out.len() + ELLIPSIS.len_utf8() > max_bytes {
            out.pop();
        }
        out.push(ELLIPSIS);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn c0_controls_are_replaced() {
        assert_eq!(
            clean("a\u{1b}[31mb\u{7}c\u{0}d", 100),
            "a\u{FFFD}[31mb\u{FFFD}c\u{FFFD}d"
        );
    }

    #[test]
    fn del_and_c1_controls_are_replaced() {
        assert_eq!(
            clean("a\u{7f}b\u{9b}2Jc\u{80}", 100),
            "a\u{FFFD}b\u{FFFD}2Jc\u{FFFD}"
        );
    }

    #[test]
    fn line_breaks_and_separators_become_one_space() {
        assert_eq!(clean("a\r\n\tb\u{2028}c\u{2029}\u{85}d", 100), "a b c d");
        assert_eq!(clean("  \n lead and trail \r\n", 100), "lead and trail");
    }

    #[test]
    fn bidi_controls_are_replaced() {
        let bidi = "\u{202A}\u{202B}\u{202C}\u{202D}\u{202E}\u{2066}\u{2067}\u{2068}\u{2069}\u{200E}\u{200F}\u{061C}";
        let cleaned = clean(&format!("x{bidi}y"), 100);
        assert_eq!(cleaned, format!("x{}y", "\u{FFFD}".repeat(12)));
    }

    #[test]
    fn printable_unicode_is_kept() {
        assert_eq!(clean("Grüße, 世界 — ok", 100), "Grüße, 世界 — ok");
    }

    #[test]
    fn length_is_capped_in_bytes_on_a_character_boundary() {
        // é is two bytes, … three.
        assert_eq!(clean("ééééé", 7), "éé…");
        assert_eq!(clean("ééééé", 8), "éé…");
        assert_eq!(clean("ééééé", 10), "ééééé");
        assert_eq!(clean("abc", 3), "abc");
        assert_eq!(clean("abcd", 0), "");
        assert_eq!(clean("abcd", 2), "ab");
        assert_eq!(clean("a b c d e", 6), "a b…");
        assert_eq!(clean(&"x".repeat(1000), 300).len(), 300);
    }

    proptest! {
        #[test]
        fn nothing_unsafe_survives(text in any::<String>(), max in 0usize..64) {
            let cleaned = clean(&text, max);
            prop_assert!(!cleaned.chars().any(is_unsafe), "{cleaned:?}");
            prop_assert!(cleaned.len() <= max);
            prop_assert_eq!(clean(&cleaned, max), cleaned.clone());
        }

        #[test]
        fn controls_among_text_never_survive(
            parts in proptest::collection::vec(
                prop_oneof![
                    "[a-z ]{0,8}",
                    proptest::char::range('\u{0}', '\u{9F}').prop_map(String::from),
                    proptest::char::range('\u{2028}', '\u{202E}').prop_map(String::from),
                    proptest::char::range('\u{2066}', '\u{2069}').prop_map(String::from),
                ],
                0..40,
            )
        ) {
            let cleaned = clean(&parts.concat(), 300);
            prop_assert!(!cleaned.chars().any(is_unsafe), "{cleaned:?}");
        }
    }
}
