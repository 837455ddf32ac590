use super::functions::{hellaswag_clean, py_capitalize, py_word_count, wikitext_detokenize};
use super::metrics::argmax;
use super::*;

#[test]
fn hellaswag_cleaning_matches_the_harness_regex() {
    assert_eq!(
        hellaswag_clean(" [header] How to grow [title] Choose a pot. [step] Water it. "),
        " How to grow. Choose a pot. Water it."
    );
    // An unclosed bracket, and one closed only after a newline, stay.
    assert_eq!(hellaswag_clean("a [b\n c] d [e"), "a [b\n c] d [e");
    assert_eq!(py_capitalize("tHE pans"), "The pans");
}

/// The harness's `wikitext_detokenizer` on a page with every rule's pattern (Python's output).
#[test]
fn wikitext_detokenizer_matches_the_harness() {
    let page: String = serde_json::from_str("\" = Valkyria Chronicles III = \\n\\n Senjō no Valkyria 3 : Unrecorded Chronicles ( Japanese : 戦場のヴァルキュリア3 , lit . Valkyria of the Battlefield 3 ) , commonly referred to as Valkyria Chronicles III outside Japan , is a tactical role @-@ playing video game . It sold 1 @,@ 000 copies at 3 @.@ 5 dollars ; the \\\" best \\\" game { of all } [ time ] . It is 25 ° C . The player s ' turn . = = Gameplay = = \\n Its N units 's work ! Really ? \\n\"").unwrap();
    let want: String = serde_json::from_str("\" = Valkyria Chronicles III =\\n\\nSenjō no Valkyria 3: Unrecorded Chronicles (Japanese: 戦場のヴァルキュリア3, lit. Valkyria of the Battlefield 3), commonly referred to as Valkyria Chronicles III outside Japan, is a tactical role-playing video game. It sold 1,000 copies at 3.5 dollars; the \\\"best\\\" game {of all} [time]. It is 25°C. The player s'turn. == Gameplay ==\\nIts 1 units's work! Really?\\n\"").unwrap();
    assert_eq!(wikitext_detokenize(&page), want);
    assert_eq!(py_word_count(&page), 97);
    assert_eq!(py_word_count(" a  b\n"), 4);
}

#[test]
fn limit_is_a_count_or_a_fraction_rounded_up() {
    assert_eq!(limit_count(Some(3.0), 10), Some(3));
    assert_eq!(limit_count(Some(0.25), 10), Some(3));
    assert_eq!(limit_count(None, 10), None);
}

#[test]
fn argmax_takes_the_first_maximum() {
    assert_eq!(argmax(&[1.0, 3.0, 3.0]), 1);
}
