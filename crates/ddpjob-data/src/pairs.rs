//! Preference pairs (`train.objective = "dpo"`): a record `{"prompt", "chosen", "rejected"}`
//! made two examples side by side, the prompt followed by each completion, the loss's tokens
//! those of the completion. Tokenised as TRL's `DPOTrainer` tokenises (trl 1.16,
//! `_prepare_dataset`): strings as `tokenizer(prompt)` and `tokenizer(prompt + completion +
//! eos)` (the end-of-sequence text appended when the completion lacks it), conversations as
//! `apply_chat_template(prompt, add_generation_prompt=True)` and `apply_chat_template(prompt +
//! completion)`; the prompt ends where the prompt's ids stop being a prefix of either whole
//! (`min` of the two common prefixes, so both completions start at one token). A record
//! without a prompt whose completions share a beginning has it taken as the prompt (TRL's
//! `extract_prompt`: Anthropic HH's layout). What becomes of the two examples (truncation,
//! nothing left to learn) is `jsonl_index`'s, for the pair as one.

use std::ops::Range;

use serde_json::Value;

use super::conversation;
use super::jsonl_index::Indexing;

/// A record's two examples (chosen's, rejected's): each its tokens and the ranges its loss is
/// on.
pub type Pair = [(Vec<u32>, Vec<Range<usize>>); 2];

/// The fields a pair's completions are in (`data.chosen_field`, `data.rejected_field`).
#[derive(Debug, Clone, Copy)]
pub struct PairFields<'a> {
    pub chosen: &'a str,
    pub rejected: &'a str,
}

/// `object`'s pair, or what is wrong with it (a missing field named, a conversation without a
/// template).
pub fn pair(
    object: &serde_json::Map<String, Value>,
    how: &Indexing,
    fields: PairFields,
) -> Result<Pair, String> {
    let get = |name: &str| {
        object.get(name).ok_or_else(|| {
            let keys: Vec<&str> = object.keys().map(String::as_str).collect();
            format!(
                "it has no \"{name}\" (data.{}_field): train.objective = \"dpo\" trains on \
                 pairs {{\"prompt\", \"chosen\", \"rejected\"}}; its fields: {}",
                if name == fields.chosen {
                    "chosen"
                } else {
                    "rejected"
                },
                keys.join(", ")
            )
        })
    };
    let (chosen, rejected) = (get(fields.chosen)?, get(fields.rejected)?);
    let prompt = object.get(how.prompt_field);
    match (prompt, chosen, rejected) {
        (_, Value::Array(_), Value::Array(_)) => {
            let chosen = conversation::messages_of(chosen, fields.chosen)?;
            let rejected = conversation::messages_of(rejected, fields.rejected)?;
            let (prompt, chosen, rejected) = match prompt {
                Some(p) => (
                    conversation::messages_of(p, how.prompt_field)?,
                    chosen,
                    rejected,
                ),
                None => shared_messages(chosen, rejected),
            };
            conversations(how, &prompt, &chosen, &rejected)
        }
        (_, Value::String(chosen), Value::String(rejected)) => {
            let (prompt, chosen, rejected) = match prompt {
                Some(Value::String(p)) => (p.clone(), chosen.as_str(), rejected.as_str()),
                Some(other) => {
                    return Err(format!(
                        "\"{}\" is not a string but {other}, while the completions are",
                        how.prompt_field
                    ));
                }
                None => shared_text(chosen, rejected),
            };
            strings(how, &prompt, chosen, rejected)
        }
        (_, c, r) => Err(format!(
            "\"{}\" and \"{}\" must be both strings or both lists of messages, not {} and {}",
            fields.chosen,
            fields.rejected,
            kind(c),
            kind(r)
        )),
    }
}

fn kind(v: &Value) -> &'static str {
    match v {
        Value::String(_) => "a string",
        Value::Array(_) => "a list",
        Value::Null => "null",
        Value::Object(_) => "an object",
        _ => "a number or boolean",
    }
}

/// String completions: each with the end-of-sequence text appended (when it lacks it), the
/// prompt and each whole encoded with the tokenizer's special tokens.
fn strings(how: &Indexing, prompt: &str, chosen: &str, rejected: &str) -> Result<Pair, String> {
    let eos = how.tokenizer.id_to_token(how.eos).unwrap_or_default();
    let ended = |c: &str| match c.ends_with(&eos) {
        true => format!("{prompt}{c}"),
        false => format!("{prompt}{c}{eos}"),
    };
    let encode = |text: &str| how.tokenizer.encode_one(text, true);
    let prompt_ids = encode(prompt)?;
    let wholes = [encode(&ended(chosen))?, encode(&ended(rejected))?];
    Ok(split(&prompt_ids, wholes))
}

/// Conversational completions, through the chat template.
fn conversations(
    how: &Indexing,
    prompt: &[Value],
    chosen: &[Value],
    rejected: &[Value],
) -> Result<Pair, String> {
    let template = how
        .chat
        .map_err(|why| format!("it is a conversation, but {why}"))?;
    let encode = |messages: &[Value], generation: bool| -> Result<Vec<u32>, String> {
        let text = template.render(messages, generation)?.text;
        Ok(how.tokenizer.encode_with_offsets(&text)?.0)
    };
    let prompt_ids = encode(prompt, true)?;
    let whole = |completion: &[Value]| {
        let all: Vec<Value> = prompt.iter().chain(completion).cloned().collect();
        encode(&all, false)
    };
    Ok(split(&prompt_ids, [whole(chosen)?, whole(rejected)?]))
}

/// The two wholes, each trained from where the prompt's ids stop being a prefix of either.
fn split(prompt: &[u32], wholes: [Vec<u32>; 2]) -> Pair {
    let shared = |whole: &[u32]| prompt.iter().zip(whole).take_while(|(a, b)| a == b).count();
    let start = shared(&wholes[0]).min(shared(&wholes[1]));
    wholes.map(|ids| {
        let span = start..ids.len();
        (ids, vec![span])
    })
}

/// TRL's `extract_prompt` for conversations: the messages both share from the start are the
/// prompt.
fn shared_messages(
    mut chosen: Vec<Value>,
    mut rejected: Vec<Value>,
) -> (Vec<Value>, Vec<Value>, Vec<Value>) {
    let n = chosen
        .iter()
        .zip(&rejected)
        .take_while(|(a, b)| a == b)
        .count();
    let prompt: Vec<Value> = chosen.drain(..n).collect();
    rejected.drain(..n);
    (prompt, chosen, rejected)
}

/// TRL's `extract_prompt` for strings: the characters both share from the start, less a
/// space they would both begin with.
fn shared_text<'a>(chosen: &'a str, rejected: &'a str) -> (String, &'a str, &'a str) {
    let mut at = chosen
        .char_indices()
        .zip(rejected.chars())
        .find(|((_, a), b)| a != b)
        .map_or(chosen.len().min(rejected.len()), |((i, _), _)| i);
    if at > 0 && chosen[..at].ends_with(' ') {
        at -= 1;
    }
    (chosen[..at].to_string(), &chosen[at..], &rejected[at..])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    #[allow(clippy::single_range_in_vec_init)]
    fn the_prompt_ends_where_either_whole_parts_from_it() {
        let [c, r] = split(&[1, 2, 3], [vec![1, 2, 3, 4, 5], vec![1, 2, 7, 8]]);
        assert_eq!(c, (vec![1, 2, 3, 4, 5], vec![2..5]));
        assert_eq!(r, (vec![1, 2, 7, 8], vec![2..4]));
    }

    #[test]
    fn a_shared_beginning_is_the_prompt() {
        assert_eq!(
            shared_text("Q: hi A: yes", "Q: hi A: no"),
            ("Q: hi A:".to_string(), " yes", " no")
        );
        let m = |r: &str, c: &str| serde_json::json!({"role": r, "content": c});
        let (p, c, r) = shared_messages(
            vec![m("user", "hi"), m("assistant", "yes")],
            vec![m("user", "hi"), m("assistant", "no")],
        );
        assert_eq!(p, vec![m("user", "hi")]);
        assert_eq!((c.len(), r.len()), (1, 1));
    }
}
