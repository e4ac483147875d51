//! The chat templates against transformers' numbers: `tests/fixtures/chat/reference.json`,
//! made by `make_chat_fixtures.py` with transformers 5.24's `apply_chat_template`.

use std::path::PathBuf;

use serde_json::Value as Json;

use super::*;
use crate::conversation;
use crate::hf_tokenizer::HfTokenizer;

fn fixture(path: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/chat")
        .join(path)
}

fn tokenizer() -> HfTokenizer {
    HfTokenizer::load(&fixture("model/tokenizer.json")).unwrap()
}

/// A template of `templates/`, with the fixture model's special tokens.
fn template(name: &str) -> ChatTemplate {
    let path = fixture(&format!("templates/{name}.jinja"));
    ChatTemplate::for_tokenizer(&fixture("model/tokenizer.json"), Some(&path))
        .unwrap()
        .unwrap()
}

fn reference() -> Json {
    serde_json::from_str(&std::fs::read_to_string(fixture("reference.json")).unwrap()).unwrap()
}

fn conversations() -> Vec<Vec<Json>> {
    std::fs::read_to_string(fixture("conversations.jsonl"))
        .unwrap()
        .lines()
        .map(|l| {
            let v: Json = serde_json::from_str(l).unwrap();
            conversation::messages_of(&v["messages"], "messages").unwrap()
        })
        .collect()
}

/// HF's labels of `ids` trained on `spans`: the id where trained, -100 elsewhere.
fn labels(ids: &[u32], spans: &[Range<usize>]) -> Vec<i64> {
    let mut out = vec![-100i64; ids.len()];
    for s in spans {
        for t in s.clone() {
            out[t] = ids[t] as i64;
        }
    }
    out
}

fn ids_of(v: &Json) -> Vec<u32> {
    let list = v.as_array().unwrap().iter();
    list.map(|x| x.as_u64().unwrap() as u32).collect()
}

fn labels_of(v: &Json) -> Vec<i64> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_i64().unwrap())
        .collect()
}

/// ChatML and Llama 3 with `{% generation %}` markers (transformers' `assistant_masks`) and
/// [INST] without (each assistant turn found by rendering prefixes): the same text, ids and
/// trained tokens as transformers gives, for every conversation.
#[test]
fn conversations_render_and_tokenise_as_apply_chat_template_does() {
    let (tok, reference) = (tokenizer(), reference());
    for name in ["chatml", "llama3", "inst"] {
        let t = template(name);
        assert_eq!(t.marked, name != "inst", "{name}");
        for (i, messages) in conversations().iter().enumerate() {
            let want = &reference[name][i];
            let rendered = t.assistant_turns(messages).unwrap();
            assert_eq!(rendered.text, want["text"].as_str().unwrap(), "{name} {i}");
            let (ids, spans) = conversation::encode(&t, &tok, messages).unwrap();
            assert_eq!(ids, ids_of(&want["input_ids"]), "{name} {i}");
            assert_eq!(
                labels(&ids, &spans),
                labels_of(&want["labels"]),
                "{name} {i}"
            );
            assert!(!spans.is_empty(), "{name} {i}: something is trained");
        }
    }
}

/// TRL's conversational prompt/completion: the loss from where the whole parts from the
/// prompt rendered with its generation prompt.
#[test]
fn a_conversational_pair_trains_on_what_the_completion_adds() {
    let (tok, reference) = (tokenizer(), reference());
    let t = template("chatml");
    for want in reference["prompt_completion"].as_array().unwrap() {
        let prompt = conversation::messages_of(&want["prompt"], "prompt").unwrap();
        let completion = conversation::messages_of(&want["completion"], "completion").unwrap();
        let (ids, spans) = conversation::encode_pair(&t, &tok, &prompt, &completion).unwrap();
        assert_eq!(ids, ids_of(&want["input_ids"]));
        assert_eq!(labels(&ids, &spans), labels_of(&want["labels"]));
    }
}

/// The model's own template: `chat_template.jinja` beside the tokenizer (transformers 5), or
/// `tokenizer_config.json`'s `chat_template`, a string or a list with a `default`.
#[test]
fn the_models_template_is_found_beside_its_tokenizer() {
    let found = ChatTemplate::for_tokenizer(&fixture("model/tokenizer.json"), None)
        .unwrap()
        .unwrap();
    let messages = &conversations()[1];
    let chatml = template("chatml");
    assert_eq!(
        found.assistant_turns(messages).unwrap(),
        chatml.assistant_turns(messages).unwrap()
    );

    let dir = tempfile::tempdir().unwrap();
    let tokenizer = dir.path().join("tokenizer.json");
    let source = std::fs::read_to_string(fixture("templates/inst.jinja")).unwrap();
    let write = |config: Json| {
        std::fs::write(dir.path().join("tokenizer_config.json"), config.to_string()).unwrap();
        ChatTemplate::for_tokenizer(&tokenizer, None)
    };
    let bos = serde_json::json!({"content": "<s>", "special": true});
    let t =
        write(serde_json::json!({"chat_template": source, "bos_token": bos, "eos_token": "</s>"}))
            .unwrap()
            .unwrap();
    let text = t.render(&messages[..3], false).unwrap().text;
    assert!(
        text.starts_with("<s> [INST] You answer") && text.ends_with("resolved.</s>"),
        "{text}"
    );
    let named = serde_json::json!([
        {"name": "tool_use", "template": "tools"},
        {"name": "default", "template": source}
    ]);
    let t = write(serde_json::json!({"chat_template": named}))
        .unwrap()
        .unwrap();
    assert!(!t.marked);
    let e = write(serde_json::json!({"chat_template": [{"name": "rag", "template": "x"}]}));
    assert!(e.err().unwrap().contains("without a \"default\""));
    assert!(
        write(serde_json::json!({"eos_token": "</s>"}))
            .unwrap()
            .is_none()
    );
}

/// A template that does not parse names its line; `raise_exception` says the template's
/// message; an assistant turn that later messages change cannot be found.
#[test]
fn template_errors_say_what_and_where() {
    let none = Default::default();
    let e = ChatTemplate::new(
        "hello\n{% for m in messages %}\n{{ m.content ",
        "`t.jinja`",
        none,
    )
    .err()
    .unwrap();
    assert!(e.contains("`t.jinja`") && e.contains("line"), "{e}");
    let t = template("inst");
    let twice =
        serde_json::json!([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]);
    let e = t.render(twice.as_array().unwrap(), false).unwrap_err();
    assert!(e.contains("Conversation roles must alternate"), "{e}");
    // Only the last assistant turn is shown whole: earlier ones are cut to 3 characters.
    let changing = ChatTemplate::new(
        "{% for m in messages %}{% if loop.last %}{{ m.content }}{% else %}{{ m.content[:3] }}\
         {% endif %}|{% endfor %}",
        "`cut.jinja`",
        Default::default(),
    )
    .unwrap();
    let m = serde_json::json!([
        {"role": "user", "content": "question"},
        {"role": "assistant", "content": "answer"},
        {"role": "user", "content": "again"}
    ]);
    let e = changing.assistant_turns(m.as_array().unwrap()).unwrap_err();
    assert!(
        e.contains("message 1") && e.contains("{% generation %}"),
        "{e}"
    );
}
