//! Chat templates: the Jinja `chat_template` of `tokenizer_config.json`, rendered with
//! minijinja the way HF `apply_chat_template` does (trim_blocks, lstrip_blocks, Python
//! string methods, `raise_exception`, `strftime_now`, `bos_token`/`eos_token`).

use super::tokenizer::{read_json_opt, special_token_text};
use crate::error::{Error, Result};
use serde::{Deserialize, Serialize};
use std::path::Path;

/// One chat message; `content` is the text (parts of a multi-part message are joined).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
}

/// [`ChatTemplate::fallback`]'s source.
pub const FALLBACK_TEMPLATE: &str = "{% for m in messages %}{% if m.role == 'system' %}\
{{ m.content }}\n\n{% else %}{{ m.role | capitalize }}: {{ m.content }}\n\n{% endif %}\
{% endfor %}{% if add_generation_prompt %}Assistant:{% endif %}";

pub struct ChatTemplate {
    env: minijinja::Environment<'static>,
    bos_token: String,
    eos_token: String,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("bos_token", &self.bos_token)
            .field("eos_token", &self.eos_token)
            .finish()
    }
}

fn raise_exception(msg: String) -> std::result::Result<String, minijinja::Error> {
    Err(minijinja::Error::new(
        minijinja::ErrorKind::InvalidOperation,
        msg,
    ))
}

/// `strftime_now(fmt)` as HF provides it; only the formats chat templates use.
fn strftime_now(fmt: String) -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0);
    let days = secs.div_euclid(86_400);
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + if m <= 2 { 1 } else { 0 };
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    let month = MONTHS[(m - 1) as usize];
    fmt.replace("%d", &format!("{d:02}"))
        .replace("%m", &format!("{m:02}"))
        .replace("%Y", &y.to_string())
        .replace("%B", month)
        .replace("%b", &month[..3])
}

impl ChatTemplate {
    /// A template from its source and the special tokens it may refer to.
    pub fn new(source: &str, bos_token: &str, eos_token: &str) -> Result<ChatTemplate> {
        let mut env = minijinja::Environment::new();
        let syntax = minijinja::syntax::SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()
            .map_err(|e| Error::Other(e.to_string()))?;
        env.set_syntax(syntax);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_template_owned("chat", source.to_string())
            .map_err(|e| Error::input(format!("the chat template does not compile: {e}")))?;
        Ok(ChatTemplate {
            env,
            bos_token: bos_token.into(),
            eos_token: eos_token.into(),
        })
    }

    /// The template for a model that ships none (as llama-server has one): plain text a base
    /// model can continue, with no special tokens —
    /// a system message as a paragraph, then `User: …` / `Assistant: …` paragraphs, ending
    /// with `Assistant:` when a reply is asked for.
    pub fn fallback() -> ChatTemplate {
        ChatTemplate::new(FALLBACK_TEMPLATE, "", "").expect("the fallback template compiles")
    }

    /// The template of a `tokenizer_config.json`, `None` when it has none (a base model).
    /// `chat_template` may be a string or a list of `{name, template}` (the `default` one
    /// is used).
    pub fn from_tokenizer_config(path: &Path) -> Result<Option<ChatTemplate>> {
        let Some(cfg) = read_json_opt(path)? else {
            return Ok(None);
        };
        let source = match cfg.get("chat_template") {
            Some(serde_json::Value::String(s)) => s.clone(),
            Some(serde_json::Value::Array(list)) => {
                let pick = list
                    .iter()
                    .find(|t| t.get("name").and_then(|n| n.as_str()) == Some("default"))
                    .or_else(|| list.first());
                match pick
                    .and_then(|t| t.get("template"))
                    .and_then(|t| t.as_str())
                {
                    Some(s) => s.to_string(),
                    None => {
                        return Err(Error::input(format!(
                            "{}: chat_template is a list without a {{name, template}} entry",
                            path.display()
                        )))
                    }
                }
            }
            Some(serde_json::Value::Null) | None => return Ok(None),
            Some(other) => {
                return Err(Error::input(format!(
                    "{}: chat_template must be a string or a list of templates, found {other}",
                    path.display()
                )))
            }
        };
        let bos = special_token_text(cfg.get("bos_token")).unwrap_or_default();
        let eos = special_token_text(cfg.get("eos_token")).unwrap_or_default();
        ChatTemplate::new(&source, &bos, &eos)
            .map(Some)
            .map_err(|e| Error::input(format!("{}: {e}", path.display())))
    }

    /// The prompt text for `messages`, ending with the assistant's header when
    /// `add_generation_prompt`.
    pub fn render(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<String> {
        let tmpl = self
            .env
            .get_template("chat")
            .map_err(|e| Error::Other(e.to_string()))?;
        tmpl.render(minijinja::context! {
            messages => minijinja::Value::from(minijinja::value::Serde(messages)),
            add_generation_prompt => add_generation_prompt,
            bos_token => &self.bos_token,
            eos_token => &self.eos_token,
        })
        .map_err(|e| Error::input(format!("rendering the chat template failed: {e}")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn llama3_style_template_renders() {
        let src = "{% for m in messages %}{% if loop.index0 == 0 %}{{ bos_token }}{% endif %}\
                   <|start|>{{ m['role'] }}\n{{ m['content'] | trim }}<|end|>{% endfor %}\
                   {% if add_generation_prompt %}<|start|>assistant\n{% endif %}";
        let t = ChatTemplate::new(src, "<s>", "</s>").unwrap();
        let msgs = vec![
            ChatMessage {
                role: "system".into(),
                content: " be brief ".into(),
            },
            ChatMessage {
                role: "user".into(),
                content: "hi".into(),
            },
        ];
        assert_eq!(
            t.render(&msgs, true).unwrap(),
            "<s><|start|>system\nbe brief<|end|><|start|>user\nhi<|end|><|start|>assistant\n"
        );
    }

    #[test]
    fn python_methods_and_exceptions() {
        let src = "{% if messages[0].role != 'user' %}{{ raise_exception('first must be user') }}\
                   {% endif %}{{ messages[0].content.strip().upper() }}";
        let t = ChatTemplate::new(src, "", "").unwrap();
        let user = ChatMessage {
            role: "user".into(),
            content: "  hey ".into(),
        };
        assert_eq!(t.render(&[user], false).unwrap(), "HEY");
        let sys = ChatMessage {
            role: "system".into(),
            content: "x".into(),
        };
        let err = t.render(&[sys], false).unwrap_err().to_string();
        assert!(err.contains("first must be user"), "{err}");
    }

    #[test]
    fn strftime_formats_a_date() {
        let s = strftime_now("%d %B %Y".into());
        let parts: Vec<&str> = s.split(' ').collect();
        assert_eq!(parts.len(), 3, "{s}");
        assert!(parts[2].parse::<i32>().unwrap() >= 2024, "{s}");
    }
}
