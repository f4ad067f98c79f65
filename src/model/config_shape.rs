//! The first look at a `config.json`: is it a model config at all? Every field has a
//! default (a config may leave out what it keeps as the official default), so `{}` would
//! otherwise read as the default 2.7B shape, and `[]` would fail with serde's words about
//! a "sequence". A config names at least one of the fields that say what model it is.

use crate::error::{Error, Result};

/// The fields a model config names at least one of.
const KEYS: [&str; 4] = ["d_model", "n_layer", "vocab_size", "ssm_cfg"];

/// Refuse text that is not a JSON object holding one of [`KEYS`].
pub fn check(text: &str, origin: &str) -> Result<()> {
    let err = |msg: String| Error::Config {
        path: origin.into(),
        msg,
    };
    let v: serde_json::Value =
        serde_json::from_str(text).map_err(|e| err(format!("not valid JSON: {e}")))?;
    let found = match &v {
        serde_json::Value::Object(m) if KEYS.iter().any(|k| m.contains_key(*k)) => {
            return check_sizes(&v, &err)
        }
        serde_json::Value::Object(m) if m.is_empty() => "an empty object".into(),
        serde_json::Value::Object(_) => format!("an object with none of {}", KEYS.join(", ")),
        serde_json::Value::Array(_) => "an array".into(),
        serde_json::Value::String(_) => "a string".into(),
        serde_json::Value::Number(_) => "a number".into(),
        serde_json::Value::Bool(_) => "a boolean".into(),
        serde_json::Value::Null => "null".into(),
    };
    Err(err(format!(
        "this is not a model config: expected a JSON object (a MambaConfig) with {}, found \
         {found}",
        KEYS.join(", ")
    )))
}

/// The size fields, at most [`MAX_SIZE`] each: the shapes derived from them (products of
/// two or three) then cannot overflow, and no real model comes near (d_model 2560,
/// vocabulary 128k).
const SIZES: [&str; 10] = [
    "d_model",
    "n_layer",
    "vocab_size",
    "d_intermediate",
    "pad_vocab_size_multiple",
    "ssm_cfg.d_state",
    "ssm_cfg.headdim",
    "ssm_cfg.ngroups",
    "ssm_cfg.chunk_size",
    "ssm_cfg.expand",
];
const MAX_SIZE: f64 = (1u64 << 24) as f64;

fn check_sizes(v: &serde_json::Value, err: &dyn Fn(String) -> Error) -> Result<()> {
    for name in SIZES {
        let found = name.split('.').try_fold(v, |node, key| node.get(key));
        let Some(given) = found else { continue };
        if given.as_f64().is_some_and(|x| x > MAX_SIZE) {
            // Shown as written (`1e300`, not three hundred digits).
            return Err(err(format!(
                "`{name}` is {given}: expected at most {MAX_SIZE} (2^24), beyond any model"
            )));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #[test]
    fn empty_and_wrong_shapes_are_not_configs() {
        for (text, found) in [
            ("[]", "an array"),
            ("{}", "an empty object"),
            ("{\"foo\": 4}", "an object with none of"),
            ("3", "a number"),
            ("null", "null"),
        ] {
            let e = super::check(text, "c.json").unwrap_err().to_string();
            assert!(e.contains("not a model config") && e.contains(found), "{e}");
        }
        super::check("{\"d_model\": 4}", "c.json").unwrap();
        let e = super::check("{\"ssm_cfg\": {\"d_state\": 1e300}}", "c.json").unwrap_err();
        assert!(e.to_string().contains("`ssm_cfg.d_state` is 1e+300"), "{e}");
    }
}
