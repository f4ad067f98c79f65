//! The pickle of a `torch.save` state dict, run by a small pickle machine that calls
//! nothing.
//!
//! It runs the opcodes of protocols 0–5 that such a file can plausibly hold:
//! `collections.OrderedDict` becomes a dict, the tensor and parameter rebuild functions
//! become tensor views ([`TensorRef`]) into storages named by torch's persistent ids
//! ([`Storage`]), storage types become dtypes, and any other global yields an opaque value,
//! an error only where a tensor or a dict is needed.

use crate::model::dtype::DType;
use crate::model::tensor_file::DiskDType;
use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::Rc;

/// Errors here are messages; the reader of the file adds the path.
pub(super) type R<T> = std::result::Result<T, String>;

/// A storage named by a persistent id: a zip record of `numel` elements.
#[derive(Debug)]
pub(super) struct Storage {
    pub(super) type_name: String,
    pub(super) dtype: Option<DiskDType>,
    pub(super) key: String,
    pub(super) numel: usize,
}

/// A tensor as pickled: a strided view into a storage.
#[derive(Debug)]
pub(super) struct TensorRef {
    pub(super) storage: Rc<Storage>,
    pub(super) offset: usize,
    pub(super) shape: Vec<usize>,
    pub(super) stride: Vec<usize>,
}

/// A pickle value. Dicts and lists are shared and mutable, as in Python: the memo holds the
/// same object that a later SETITEMS or APPENDS fills in.
#[derive(Clone, Debug)]
pub(super) enum Value {
    None,
    Bool(bool),
    Int(i64),
    Float(f64),
    Str(Rc<str>),
    Bytes(usize),
    Tuple(Rc<Vec<Value>>),
    List(Rc<RefCell<Vec<Value>>>),
    Dict(Rc<RefCell<Vec<(Value, Value)>>>),
    Global(Rc<str>),
    Storage(Rc<Storage>),
    Tensor(Rc<TensorRef>),
    Opaque(Rc<str>),
}

/// How error messages name a value.
impl std::fmt::Display for Value {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Value::None => write!(f, "None"),
            Value::Bool(b) => write!(f, "the bool {b}"),
            Value::Int(i) => write!(f, "the int {i}"),
            Value::Float(x) => write!(f, "the float {x}"),
            Value::Str(s) => write!(f, "the string {s:?}"),
            Value::Bytes(n) => write!(f, "{n} bytes"),
            Value::Tuple(t) => write!(f, "a tuple of {} items", t.len()),
            Value::List(l) => write!(f, "a list of {} items", l.borrow().len()),
            Value::Dict(d) => write!(f, "a dict of {} entries", d.borrow().len()),
            Value::Global(g) => write!(f, "the global {g}"),
            Value::Storage(s) => write!(f, "storage `{}` ({})", s.key, s.type_name),
            Value::Tensor(_) => write!(f, "a tensor"),
            Value::Opaque(s) => write!(f, "an object built by {s}"),
        }
    }
}

fn tuple(items: Vec<Value>) -> Value {
    Value::Tuple(Rc::new(items))
}

/// Key/value pairs from a flat run of items (DICT, SETITEMS).
fn pairs(items: Vec<Value>) -> R<Vec<(Value, Value)>> {
    if !items.len().is_multiple_of(2) {
        return Err(format!(
            "expected key/value pairs, found {} items",
            items.len()
        ));
    }
    let mut it = items.into_iter();
    Ok(std::iter::from_fn(|| Some((it.next()?, it.next()?))).collect())
}

pub(super) struct Vm<'a> {
    data: &'a [u8],
    pos: usize,
    stack: Vec<Value>,
    /// Stack heights at each MARK (Python's metastack): nothing pops below the last one.
    marks: Vec<usize>,
    memo: HashMap<u64, Value>,
}

impl<'a> Vm<'a> {
    pub(super) fn new(data: &'a [u8]) -> Self {
        let (stack, marks, memo) = (Vec::new(), Vec::new(), HashMap::new());
        Vm {
            data,
            pos: 0,
            stack,
            marks,
            memo,
        }
    }

    pub(super) fn run(mut self) -> R<Value> {
        loop {
            let at = self.pos;
            let Some(&op) = self.data.get(at) else {
                return Err(format!(
                    "the pickle ends at byte {at} without a STOP opcode"
                ));
            };
            self.pos += 1;
            match self.step(op) {
                Ok(Some(v)) => return Ok(v),
                Ok(None) => {}
                Err(e) => return Err(format!("{e} (opcode 0x{op:02x} at byte {at})")),
            }
        }
    }

    fn take(&mut self, n: u64) -> R<&'a [u8]> {
        let left = self.data.len() - self.pos;
        if n > left as u64 {
            return Err(format!(
                "truncated: expected {n} bytes of argument, found {left}"
            ));
        }
        let s = &self.data[self.pos..self.pos + n as usize];
        self.pos += n as usize;
        Ok(s)
    }
    /// A little-endian unsigned argument of `width` bytes.
    fn uint(&mut self, width: u64) -> R<u64> {
        Ok(self
            .take(width)?
            .iter()
            .rev()
            .fold(0, |a, &b| a << 8 | b as u64))
    }
    /// A newline-terminated argument (protocol 0 opcodes).
    fn line_bytes(&mut self) -> R<&'a [u8]> {
        let rest = &self.data[self.pos..];
        let n = (rest.iter().position(|&b| b == b'\n')).ok_or("truncated: no end of line")?;
        self.pos += n + 1;
        Ok(&rest[..n])
    }
    fn line(&mut self) -> R<&'a str> {
        std::str::from_utf8(self.line_bytes()?).map_err(|_| "text argument is not UTF-8".into())
    }
    fn pop_n(&mut self, n: usize) -> R<Vec<Value>> {
        let floor = self.marks.last().copied().unwrap_or(0);
        if self.stack.len() < floor + n {
            return Err(format!("stack underflow: {n} items needed"));
        }
        Ok(self.stack.split_off(self.stack.len() - n))
    }
    fn pop(&mut self) -> R<Value> {
        self.pop_n(1)?.pop().ok_or_else(|| "stack underflow".into())
    }
    fn pop_mark(&mut self) -> R<Vec<Value>> {
        let m = self.marks.pop().ok_or("no MARK on the stack")?;
        Ok(self.stack.split_off(m.min(self.stack.len())))
    }
    fn top(&mut self) -> R<Value> {
        let v = self.pop()?;
        self.stack.push(v.clone());
        Ok(v)
    }

    /// Run one opcode; `Some` at STOP.
    fn step(&mut self, op: u8) -> R<Option<Value>> {
        let v = match op {
            0x80 => return self.take(1).map(|_| None), // PROTO: the opcodes say what we need
            0x95 => return self.take(8).map(|_| None), // FRAME: only a buffering hint
            b'.' => return self.pop().map(Some),
            b'(' => {
                self.marks.push(self.stack.len());
                return Ok(None);
            }
            b'}' => Value::Dict(Rc::default()),
            b']' | 0x8f => Value::List(Rc::default()), // EMPTY_LIST, EMPTY_SET
            b')' => tuple(Vec::new()),
            b't' | 0x91 => tuple(self.pop_mark()?), // TUPLE, FROZENSET
            0x85..=0x87 => tuple(self.pop_n((op - 0x84) as usize)?),
            b'l' => Value::List(Rc::new(RefCell::new(self.pop_mark()?))),
            b'd' => Value::Dict(Rc::new(RefCell::new(pairs(self.pop_mark()?)?))),
            // Length-prefixed text and bytes, by the width of the length. Text is decoded
            // leniently: a bad name surfaces as a missing tensor, with the name shown.
            b'X' | 0x8c | 0x8d | b'T' | b'U' | b'B' | b'C' | 0x8e => {
                let width = match op {
                    0x8c | b'U' | b'C' => 1,
                    0x8d | 0x8e => 8,
                    _ => 4,
                };
                let n = self.uint(width)?;
                let b = self.take(n)?;
                match op {
                    b'B' | b'C' | 0x8e => Value::Bytes(b.len()), // never part of a state dict
                    _ => Value::Str(String::from_utf8_lossy(b).into()),
                }
            }
            b'V' => Value::Str(raw_unicode_escape(self.line_bytes()?)?.into()),
            b'K' => Value::Int(self.uint(1)? as i64),
            b'M' => Value::Int(self.uint(2)? as i64),
            b'J' => Value::Int(self.uint(4)? as u32 as i32 as i64),
            0x8a | 0x8b => {
                let n = self.uint(if op == 0x8a { 1 } else { 4 })?;
                long_le(self.take(n)?)
            }
            b'I' | b'L' => match (op, self.line()?.trim()) {
                (b'I', "00") => Value::Bool(false),
                (b'I', "01") => Value::Bool(true),
                // Wider than 64 bits: opaque, an error only if used as a size.
                (_, s) => (s.trim_end_matches('L').parse())
                    .map_or_else(|_| Value::Opaque(format!("the int {s}").into()), Value::Int),
            },
            b'G' => Value::Float(f64::from_bits(self.uint(8)?.swap_bytes())), // big-endian
            b'F' => {
                let s = self.line()?.trim();
                Value::Float(s.parse().map_err(|_| format!("invalid float {s:?}"))?)
            }
            b'N' => Value::None,
            0x88 | 0x89 => Value::Bool(op == 0x88),
            b'c' => Value::Global(format!("{}.{}", self.line()?, self.line()?).into()),
            0x93 => match (self.pop()?, self.pop()?) {
                (Value::Str(name), Value::Str(module)) => {
                    Value::Global(format!("{module}.{name}").into())
                }
                (n, m) => return Err(format!("STACK_GLOBAL needs two strings, found {m}, {n}")),
            },
            // REDUCE is func(*args); NEWOBJ cls.__new__(cls, *args): the same to us.
            b'R' | 0x81 => {
                let args = self.pop()?;
                call(&self.pop()?, &args)?
            }
            0x92 => match self.pop_n(3)?.as_slice() {
                [cls, args, _kwargs] => call(cls, args)?, // NEWOBJ_EX
                _ => return Err("stack underflow".into()),
            },
            // BUILD sets attributes (e.g. an OrderedDict's `_metadata`): nothing we need.
            b'b' => return self.pop().and_then(|_| self.top()).map(|_| None),
            b's' | b'u' => {
                let items = if op == b's' {
                    self.pop_n(2)
                } else {
                    self.pop_mark()
                }?;
                match self.top()? {
                    Value::Dict(d) => d.borrow_mut().extend(pairs(items)?), // last duplicate wins
                    Value::Opaque(_) => {} // a custom mapping we do not model
                    other => return Err(format!("cannot set items on {other}")),
                }
                return Ok(None);
            }
            b'a' | b'e' | 0x90 => {
                // APPEND, APPENDS, ADDITEMS
                let items = if op == b'a' {
                    self.pop_n(1)
                } else {
                    self.pop_mark()
                }?;
                match self.top()? {
                    Value::List(l) => l.borrow_mut().extend(items),
                    Value::Opaque(_) => {}
                    other => return Err(format!("cannot append to {other}")),
                }
                return Ok(None);
            }
            // PUT and GET in three widths; MEMOIZE puts at the next index.
            b'q' | b'r' | b'p' | 0x94 | b'h' | b'j' | b'g' => {
                let idx = match op {
                    b'q' | b'h' => self.uint(1)?,
                    b'r' | b'j' => self.uint(4)?,
                    b'p' | b'g' => {
                        let s = self.line()?.trim();
                        s.parse().map_err(|_| format!("invalid memo index {s:?}"))?
                    }
                    _ => self.memo.len() as u64,
                };
                if !matches!(op, b'h' | b'j' | b'g') {
                    let v = self.top()?;
                    self.memo.insert(idx, v);
                    return Ok(None);
                }
                let v = self.memo.get(&idx).cloned();
                v.ok_or_else(|| format!("memo entry {idx} was never stored"))?
            }
            b'Q' => persistent_load(&self.pop()?)?,
            b'P' => persistent_load(&Value::Str(self.line()?.into()))?,
            b'0' => {
                // POP removes a MARK if that is what is on top.
                if self.marks.last() == Some(&self.stack.len()) {
                    self.marks.pop();
                } else {
                    self.pop()?;
                }
                return Ok(None);
            }
            b'1' => return self.pop_mark().map(|_| None),
            b'2' => self.top()?,
            _ => return Err("unknown or unsupported pickle opcode".into()),
        };
        self.stack.push(v);
        Ok(None)
    }
}

/// A two's-complement little-endian integer (LONG1, LONG4).
fn long_le(b: &[u8]) -> Value {
    if b.len() > 8 {
        return Value::Opaque("an int wider than 64 bits".into());
    }
    let negative = b.last().is_some_and(|&x| x & 0x80 != 0);
    let mut a = [if negative { 0xff } else { 0 }; 8];
    a[..b.len()].copy_from_slice(b);
    Value::Int(i64::from_le_bytes(a))
}

/// Python's `raw-unicode-escape`: latin-1 text with `\uXXXX` and `\UXXXXXXXX` escapes.
fn raw_unicode_escape(b: &[u8]) -> R<String> {
    let (mut out, mut i) = (String::new(), 0);
    while i < b.len() {
        let n = match (b[i], b.get(i + 1)) {
            (b'\\', Some(b'u')) => 4,
            (b'\\', Some(b'U')) => 8,
            (c, _) => {
                out.push(c as char);
                i += 1;
                continue;
            }
        };
        let hex = b
            .get(i + 2..i + 2 + n)
            .and_then(|h| std::str::from_utf8(h).ok());
        let c = hex
            .and_then(|h| u32::from_str_radix(h, 16).ok())
            .and_then(char::from_u32);
        out.push(c.ok_or_else(|| format!("invalid \\u escape at byte {i} of UNICODE text"))?);
        i += 2 + n;
    }
    Ok(out)
}

fn as_usize(v: &Value, what: &str) -> R<usize> {
    match v {
        Value::Int(i) => usize::try_from(*i).map_err(|_| format!("{what} must be ≥ 0, found {i}")),
        other => Err(format!("{what} must be an int, found {other}")),
    }
}

fn usize_tuple(v: &Value, what: &str) -> R<Vec<usize>> {
    match v {
        Value::Tuple(t) => t.iter().map(|x| as_usize(x, what)).collect(),
        other => Err(format!("{what} must be a tuple of ints, found {other}")),
    }
}

/// Apply a global to its arguments: only the few callables a state dict needs mean anything.
fn call(func: &Value, args: &Value) -> R<Value> {
    let Value::Global(f) = func else {
        return Ok(Value::Opaque(format!("a call of {func}").into()));
    };
    let args = match args {
        Value::Tuple(t) => t.as_slice(),
        _ => &[],
    };
    match (&**f, args) {
        // Filled in afterwards by SETITEMS.
        ("collections.OrderedDict", _) => Ok(Value::Dict(Rc::default())),
        (
            "torch._utils._rebuild_tensor_v2" | "torch._utils._rebuild_tensor",
            [Value::Storage(storage), offset, size, stride, ..],
        ) => {
            let (shape, stride) = (usize_tuple(size, "size")?, usize_tuple(stride, "stride")?);
            if shape.len() != stride.len() {
                return Err(format!(
                    "{f}: size {shape:?} and stride {stride:?} differ in rank"
                ));
            }
            let (storage, offset) = (storage.clone(), as_usize(offset, "storage_offset")?);
            Ok(Value::Tensor(Rc::new(TensorRef {
                storage,
                offset,
                shape,
                stride,
            })))
        }
        ("torch._utils._rebuild_tensor_v2" | "torch._utils._rebuild_tensor", _) => {
            let found = tuple(args.to_vec());
            Err(format!(
                "{f} expects (storage, offset, size, stride, ...), found {found}"
            ))
        }
        // A Parameter is its data tensor.
        ("torch._utils._rebuild_parameter" | "torch._utils._rebuild_parameter_with_state", _) => {
            match args.first() {
                Some(t @ Value::Tensor(_)) => Ok(t.clone()),
                Some(other) => Err(format!("{f} expects a tensor, found {other}")),
                None => Err(format!("{f} expects a tensor, found no arguments")),
            }
        }
        // Tensor subclasses: (func, type, args, state) → func(*args).
        ("torch._tensor._rebuild_from_type_v2", [func, _, args, ..]) => call(func, args),
        _ => Ok(Value::Opaque(format!("{f}(...)").into())),
    }
}

pub(super) const STORAGES: [(&str, DiskDType); 10] = [
    ("torch.FloatStorage", DiskDType::Float(DType::F32)),
    ("torch.BFloat16Storage", DiskDType::Float(DType::BF16)),
    ("torch.HalfStorage", DiskDType::Float(DType::F16)),
    ("torch.DoubleStorage", DiskDType::Float(DType::F64)),
    ("torch.LongStorage", DiskDType::I64),
    ("torch.IntStorage", DiskDType::I32),
    ("torch.ShortStorage", DiskDType::I16),
    ("torch.CharStorage", DiskDType::I8),
    ("torch.ByteStorage", DiskDType::U8),
    ("torch.BoolStorage", DiskDType::Bool),
];

/// torch's persistent ids: `("storage", storage_type, key, location, numel)`. Anything else
/// is opaque.
fn persistent_load(pid: &Value) -> R<Value> {
    let items = match pid {
        Value::Tuple(t) => t.as_slice(),
        _ => &[],
    };
    let [Value::Str(tag), Value::Global(ty), key, _location, numel] = items else {
        return Ok(Value::Opaque(format!("persistent id {pid}").into()));
    };
    if &**tag != "storage" {
        return Ok(Value::Opaque(format!("persistent id {pid}").into()));
    }
    let key = match key {
        Value::Str(s) => s.to_string(),
        Value::Int(i) => i.to_string(),
        other => return Err(format!("expected a storage key string, found {other}")),
    };
    let storage = Storage {
        type_name: ty.to_string(),
        // Unsupported types are an error only if a tensor we return uses them.
        dtype: STORAGES.iter().find(|(n, _)| *n == &**ty).map(|&(_, d)| d),
        key,
        numel: as_usize(numel, "storage numel")?,
    };
    Ok(Value::Storage(Rc::new(storage)))
}
