//! Conversations as training examples: TRL's `{"messages": [{"role", "content"}, ...]}` and
//! its conversational prompt/completion (`"prompt": [messages], "completion": [messages]`),
//! checked message by message, rendered through the model's chat template and tokenised as
//! `apply_chat_template(messages, tokenize=True)` tokenises (the rendered text encoded without
//! adding special tokens: the template writes them), with the tokens the loss is on: those
//! overlapping the assistant's text (transformers' `assistant_masks` rule), or for a
//! prompt/completion pair what the whole adds to the prompt rendered with its generation
//! prompt (as TRL's SFTTrainer masks it: from where the two token sequences part).

use std::ops::Range;

use serde_json::Value as Json;

use super::chat::ChatTemplate;
use super::hf_tokenizer::HfTokenizer;

/// The roles a message may have.
const ROLES: [&str; 5] = ["system", "developer", "user", "assistant", "tool"];

/// `value` (a line's or a row's `messages`) checked as a conversation: a list of objects, each
/// with a known `role` and a string `content`; keys whose value is null are dropped (as
/// transformers drops them before rendering). `what` names the field in errors.
pub fn messages_of(value: &Json, what: &str) -> Result<Vec<Json>, String> {
    let Json::Array(list) = value else {
        return Err(format!(
            "\"{what}\" is not a list of messages but {}",
            short(value)
        ));
    };
    if list.is_empty() {
        return Err(format!(
            "\"{what}\" is an empty list: a conversation needs messages"
        ));
    }
    let mut out = Vec::with_capacity(list.len());
    for (i, m) in list.iter().enumerate() {
        let Json::Object(fields) = m else {
            return Err(format!(
                "\"{what}\"[{i}] is not a message object but {}",
                short(m)
            ));
        };
        let fields: serde_json::Map<String, Json> = (fields.iter())
            .filter(|(_, v)| !v.is_null())
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        match fields.get("role") {
            Some(Json::String(role)) if ROLES.contains(&role.as_str()) => {}
            Some(Json::String(role)) => {
                return Err(format!(
                    "\"{what}\"[{i}] has the role \"{role}\"; roles are {}",
                    ROLES.join(", ")
                ));
            }
            Some(other) => {
                return Err(format!(
                    "\"{what}\"[{i}]'s role is not a string but {}",
                    short(other)
                ));
            }
            None => return Err(format!("\"{what}\"[{i}] has no \"role\"")),
        }
        match fields.get("content") {
            Some(Json::String(_)) => {}
            // An assistant turn that only calls tools has no content.
            None if fields.contains_key("tool_calls") => {}
            Some(other) => {
                return Err(format!(
                    "\"{what}\"[{i}]'s content is not a string but {} (multimodal content \
                     lists are not read: give the text)",
                    short(other)
                ));
            }
            None => return Err(format!("\"{what}\"[{i}] has no \"content\"")),
        }
        out.push(Json::Object(fields));
    }
    Ok(out)
}

/// A value shortened for an error.
fn short(v: &Json) -> String {
    let text = v.to_string();
    match text.char_indices().nth(60) {
        Some((at, _)) => format!("{}…", &text[..at]),
        None => text,
    }
}

/// A conversation's tokens and the token ranges its loss is on.
pub fn encode(
    template: &ChatTemplate,
    tokenizer: &HfTokenizer,
    messages: &[Json],
) -> Result<(Vec<u32>, Vec<Range<usize>>), String> {
    let rendered = template.assistant_turns(messages)?;
    let (ids, offsets) = tokenizer.encode_with_offsets(&rendered.text)?;
    Ok((ids, tokens_overlapping(&offsets, &rendered.trained)))
}

/// A conversational prompt/completion pair's tokens (the whole conversation rendered) and the
/// range its loss is on: from where they part from the prompt's (rendered with the
/// generation prompt), to the end.
pub fn encode_pair(
    template: &ChatTemplate,
    tokenizer: &HfTokenizer,
    prompt: &[Json],
    completion: &[Json],
) -> Result<(Vec<u32>, Vec<Range<usize>>), String> {
    let prompt_text = template.render(prompt, true)?.text;
    let whole: Vec<Json> = prompt.iter().chain(completion).cloned().collect();
    let whole_text = template.render(&whole, false)?.text;
    let (prompt_ids, _) = tokenizer.encode_with_offsets(&prompt_text)?;
    let (ids, _) = tokenizer.encode_with_offsets(&whole_text)?;
    let shared = prompt_ids
        .iter()
        .zip(&ids)
        .take_while(|(a, b)| a == b)
        .count();
    let completion = shared..ids.len();
    Ok((ids, vec![completion]))
}

/// The token ranges whose byte `offsets` overlap one of `spans` (bytes of the same text):
/// transformers' rule for `assistant_masks`, so a token a span cuts is trained.
pub fn tokens_overlapping(offsets: &[(usize, usize)], spans: &[Range<usize>]) -> Vec<Range<usize>> {
    let mut out: Vec<Range<usize>> = Vec::new();
    let mut span = 0;
    for (t, &(start, end)) in offsets.iter().enumerate() {
        while span < spans.len() && start >= spans[span].end {
            span += 1;
        }
        if span == spans.len() {
            break;
        }
        if end > spans[span].start {
            match out.last_mut() {
                Some(last) if last.end == t => last.end = t + 1,
                _ => out.push(t..t + 1),
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    #[allow(clippy::single_range_in_vec_init)]
    fn tokens_overlapping_a_span_are_trained() {
        // Tokens [0,3) [3,5) [5,9) [9,10); spans [4,6) and [9,10).
        let offsets = [(0, 3), (3, 5), (5, 9), (9, 10)];
        assert_eq!(tokens_overlapping(&offsets, &[4..6, 9..10]), vec![1..4]);
        assert_eq!(tokens_overlapping(&offsets, &[0..3]), vec![0..1]);
        assert_eq!(
            tokens_overlapping(&offsets, &[]),
            Vec::<Range<usize>>::new()
        );
    }

    #[test]
    fn bad_messages_are_named() {
        let bad = |v: Json| messages_of(&v, "messages").unwrap_err();
        assert!(bad(serde_json::json!("hi")).contains("not a list of messages"));
        assert!(bad(serde_json::json!([])).contains("empty list"));
        assert!(bad(serde_json::json!([{"content": "x"}])).contains("[0] has no \"role\""));
        let e = bad(
            serde_json::json!([{"role": "user", "content": "a"}, {"role": "bot", "content": "b"}]),
        );
        assert!(
            e.contains("\"messages\"[1] has the role \"bot\"") && e.contains("assistant"),
            "{e}"
        );
        let e = bad(serde_json::json!([{"role": "user", "content": [{"type": "text"}]}]));
        assert!(
            e.contains("not a string") && e.contains("multimodal"),
            "{e}"
        );
        let ok = messages_of(
            &serde_json::json!([{"role": "user", "content": "a", "name": null}]),
            "messages",
        )
        .unwrap();
        assert_eq!(
            ok,
            vec![serde_json::json!({"role": "user", "content": "a"})]
        );
    }
}
