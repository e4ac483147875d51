//! `data.dataset = "jsonl"`'s keys and what each says (`ddpjob keys`, the config reference),
//! apart from the options that read them (`jsonl`); parquet's and Arrow's are these, with
//! their paths said for their files (`parquet`).

use std::sync::LazyLock;

use super::corpus::TEXT_ROWS_KEY;
use super::hub_source::HUB_KEYS;
use ddpjob_spec::KeyDoc;

/// `data.dataset = "jsonl"`'s keys: the rows' own, then the Hub's (refused for jsonl).
pub static JSONL_KEYS: LazyLock<Vec<KeyDoc>> =
    LazyLock::new(|| ROW_KEYS.iter().chain(HUB_KEYS).copied().collect());

const ROW_KEYS: &[KeyDoc] = &[
    KeyDoc {
        key: "train_path",
        default: "required",
        doc: "JSONL, one object a line: `{\"prompt\": ..., \"completion\": ...}`, \
              `{\"text\": ...}`, or a conversation `{\"messages\": [{\"role\", \"content\"}, \
              ...]}` (TRL's formats; a prompt and completion may be lists of messages too); \
              read once, streaming",
    },
    KeyDoc {
        key: "val_path",
        default: "none",
        doc: "the validation examples, same format; without it the last `val_fraction` of \
              `train_path`'s",
    },
    KeyDoc {
        key: "val_fraction",
        default: "`0.1`",
        doc: "without `val_path`: this last fraction of the examples is the validation split",
    },
    KeyDoc {
        key: "text_field",
        default: "`\"text\"`",
        doc: "a line without a completion: this field is the example, trained on whole",
    },
    KeyDoc {
        key: "prompt_field",
        default: "`\"prompt\"`",
        doc: "the prompt of a prompt/completion line",
    },
    KeyDoc {
        key: "completion_field",
        default: "`\"completion\"`",
        doc: "the completion; a line that has it is a prompt/completion example",
    },
    KeyDoc {
        key: "messages_field",
        default: "`\"messages\"`",
        doc: "a line with it is a conversation, rendered through the chat template",
    },
    KeyDoc {
        key: "chosen_field",
        default: "`\"chosen\"`",
        doc: "`train.objective = \"dpo\"`: the preferred completion of a pair `{\"prompt\", \
              \"chosen\", \"rejected\"}` (strings, or lists of messages; without a prompt, the \
              beginning both completions share is the prompt, as TRL reads Anthropic HH). A \
              pair left with nothing to learn (a completion empty after truncation, or chosen \
              the same as rejected) is left out and counted",
    },
    KeyDoc {
        key: "rejected_field",
        default: "`\"rejected\"`",
        doc: "`train.objective = \"dpo\"`: the dispreferred completion of a pair",
    },
    KeyDoc {
        key: "chat_template",
        default: "the model's",
        doc: "a Jinja file that renders conversations, instead of the model's own \
              (`chat_template.jinja` beside its tokenizer, or `tokenizer_config.json`'s \
              `chat_template`)",
    },
    KeyDoc {
        key: "train_on_prompt",
        default: "`false`",
        doc: "`false`: the loss is on the completion's tokens only (the SFT default), in a \
              conversation on the assistant's turns (the template's `{% generation %}` blocks, \
              or each assistant message found by rendering the conversation's prefixes)",
    },
    KeyDoc {
        key: "pack",
        default: "`false`",
        doc: "`true`: several examples a row (in file order, up to `block_size` positions), \
              positions and attention restarted at each; `false`: one example a row, padded to \
              the longest in its batch",
    },
    KeyDoc {
        key: "truncate",
        default: "`true`",
        doc: "cut an example longer than `model.block_size + 1` tokens (counted in the log); \
              `false`: refuse it",
    },
    KeyDoc {
        key: "skip_bad_lines",
        default: "`false`",
        doc: "count and skip lines that are not JSON or lack the fields, instead of refusing \
              the file",
    },
    TEXT_ROWS_KEY,
    KeyDoc {
        key: "tokenizer",
        default: "the model's `tokenizer.json`",
        doc: "the Hugging Face `tokenizer.json` the examples are encoded with",
    },
    KeyDoc {
        key: "eos_token",
        default: "the tokenizer's (`tokenizer_config.json`, else `config.json`)",
        doc: "appended to every example, e.g. `\"</s>\"`",
    },
];
