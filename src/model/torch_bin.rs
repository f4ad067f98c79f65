//! Reading `torch.save` checkpoints (the zip format of PyTorch ≥ 1.6, which is how official
//! `pytorch_model.bin` files are published) without Python.
//!
//! The zip holds `<archive>/data.pkl`, a pickle of the state dict, and one record
//! `<archive>/data/<key>` per storage with its raw bytes (little-endian, as
//! `<archive>/byteorder` says when present). In the pickle each tensor is a call
//! `torch._utils._rebuild_tensor_v2(storage, offset, size, stride, ...)` whose storage is the
//! persistent id `("storage", torch.FloatStorage, key, location, numel)`.
//!
//! A small pickle machine runs the opcodes of protocols 0–5 that such a file can plausibly
//! hold, but calls nothing: `collections.OrderedDict` becomes a dict, the tensor and parameter
//! rebuild functions become tensor views, storage types become dtypes, and any other global
//! yields an opaque value, an error only where a tensor or a dict is needed.

use crate::error::{Error, Result};
use crate::model::dtype::DType;
use crate::model::tensor_file::{DiskDType, RawTensor};
use std::borrow::Cow;
use std::cell::RefCell;
use std::collections::{BTreeMap, HashMap};
use std::io::Read;
use std::path::Path;
use std::rc::Rc;

type Zip = zip::ZipArchive<std::io::BufReader<std::fs::File>>;

/// Read every tensor of a `torch.save` zip (a state dict, possibly nested one level in
/// a dict under a key such as "state_dict" or "model"), as contiguous little-endian bytes.
pub fn read(path: &Path) -> Result<BTreeMap<String, RawTensor<'static>>> {
    let bad = |msg: String| Error::checkpoint(path.display(), msg);
    let file = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
    let file_len = file.metadata().map_err(|e| Error::io(path, e))?.len();
    let mut zip = zip::ZipArchive::new(std::io::BufReader::new(file)).map_err(|e| {
        bad(format!(
            "expected a torch.save zip archive, but it cannot be read as one: {e}"
        ))
    })?;

    // The archive prefix is the saved file's stem (`archive/`, `pytorch_model/`, ...).
    let pkl = zip
        .file_names()
        .filter(|n| n.ends_with("/data.pkl") || *n == "data.pkl")
        .min_by_key(|n| n.len())
        .map(str::to_owned)
        .ok_or_else(|| {
            bad("expected a zip entry `<archive>/data.pkl` (a torch.save file), found none".into())
        })?;
    let prefix = &pkl[..pkl.len() - "data.pkl".len()];

    if let Some(order) = read_entry(&mut zip, &format!("{prefix}byteorder"), path, file_len)? {
        let order = String::from_utf8_lossy(&order);
        if order.trim() != "little" {
            return Err(bad(format!(
                "expected byte order \"little\" in `{prefix}byteorder`, found {:?}: big-endian checkpoints are not supported",
                order.trim()
            )));
        }
    }

    let pickle = read_entry(&mut zip, &pkl, path, file_len)?
        .ok_or_else(|| bad(format!("zip entry `{pkl}` vanished while reading")))?;
    let root = Vm::new(&pickle)
        .run()
        .map_err(|e| bad(format!("`{pkl}`: {e}")))?;
    let tensors = select_state_dict(&root).map_err(|e| bad(format!("`{pkl}`: {e}")))?;

    // Group by storage so each record is read once (tied weights share one) and dropped after.
    let mut by_storage: BTreeMap<&str, Vec<(&str, &TensorRef)>> = BTreeMap::new();
    for (name, t) in &tensors {
        by_storage
            .entry(t.storage.key.as_str())
            .or_default()
            .push((name, t));
    }
    let mut out = BTreeMap::new();
    for (key, users) in by_storage {
        let entry = format!("{prefix}data/{key}");
        let bytes = read_entry(&mut zip, &entry, path, file_len)?.ok_or_else(|| {
            bad(format!(
                "tensor `{}` needs storage record `{entry}`, which the zip does not contain",
                users[0].0
            ))
        })?;
        for (name, t) in users {
            let (dtype, data) = materialise(name, t, &entry, &bytes).map_err(bad)?;
            out.insert(
                name.to_owned(),
                RawTensor {
                    dtype,
                    shape: t.shape.clone(),
                    bytes: Cow::Owned(data),
                },
            );
        }
    }
    Ok(out)
}

/// The bytes of one zip entry, or `None` if there is no such entry.
fn read_entry(zip: &mut Zip, name: &str, path: &Path, file_len: u64) -> Result<Option<Vec<u8>>> {
    let bad = |e: &dyn std::fmt::Display| {
        Error::checkpoint(
            path.display(),
            format!("zip entry `{name}` cannot be read: {e}"),
        )
    };
    let mut f = match zip.by_name(name) {
        Ok(f) => f,
        Err(zip::result::ZipError::FileNotFound) => return Ok(None),
        Err(e) => return Err(bad(&e)),
    };
    // The declared size comes from the file: never trust it for more than the file's length.
    let mut buf = Vec::with_capacity(f.size().min(file_len) as usize);
    f.read_to_end(&mut buf).map_err(|e| bad(&e))?;
    Ok(Some(buf))
}

/// A storage named by a persistent id: a zip record of `numel` elements.
#[derive(Debug)]
struct Storage {
    type_name: String,
    dtype: Option<DiskDType>,
    key: String,
    numel: usize,
}

/// A tensor as pickled: a strided view into a storage.
#[derive(Debug)]
struct TensorRef {
    storage: Rc<Storage>,
    offset: usize,
    shape: Vec<usize>,
    stride: Vec<usize>,
}

/// A pickle value. Dicts and lists are shared and mutable, as in Python: the memo holds the
/// same object that later SETITEMS/APPENDS fill in.
#[derive(Clone, Debug)]
enum Value {
    None,
    Bool(bool),
    Int(i64),
    Float(f64),
    Str(Rc<str>),
    Bytes(usize),
    Tuple(Rc<Vec<Value>>),
    List(Rc<RefCell<Vec<Value>>>),
    Dict(Rc<RefCell<Vec<(Value, Value)>>>),
    Global(Rc<(String, String)>),
    Storage(Rc<Storage>),
    Tensor(Rc<TensorRef>),
    Opaque(Rc<str>),
}

fn describe(v: &Value) -> String {
    match v {
        Value::None => "None".into(),
        Value::Bool(b) => format!("the bool {b}"),
        Value::Int(i) => format!("the int {i}"),
        Value::Float(f) => format!("the float {f}"),
        Value::Str(s) => format!("the string {s:?}"),
        Value::Bytes(n) => format!("{n} bytes"),
        Value::Tuple(t) => format!("a tuple of {} items", t.len()),
        Value::List(l) => format!("a list of {} items", l.borrow().len()),
        Value::Dict(d) => format!("a dict of {} entries", d.borrow().len()),
        Value::Global(g) => format!("the global {}.{}", g.0, g.1),
        Value::Storage(s) => format!("storage `{}` ({})", s.key, s.type_name),
        Value::Tensor(_) => "a tensor".into(),
        Value::Opaque(s) => format!("an object built by {s}"),
    }
}

type VmResult<T> = std::result::Result<T, String>;

struct Vm<'a> {
    data: &'a [u8],
    pos: usize,
    stack: Vec<Value>,
    /// Stack heights at each MARK (Python's metastack).
    marks: Vec<usize>,
    memo: HashMap<u64, Value>,
}

impl<'a> Vm<'a> {
    fn new(data: &'a [u8]) -> Self {
        Vm {
            data,
            pos: 0,
            stack: Vec::new(),
            marks: Vec::new(),
            memo: HashMap::new(),
        }
    }

    fn run(mut self) -> VmResult<Value> {
        loop {
            let at = self.pos;
            let op = *self
                .data
                .get(at)
                .ok_or_else(|| format!("pickle ends at byte {at} without a STOP opcode"))?;
            self.pos += 1;
            match self.step(op) {
                Ok(Some(v)) => return Ok(v),
                Ok(None) => {}
                Err(e) => return Err(format!("{e} (opcode 0x{op:02x} at byte {at})")),
            }
        }
    }

    fn take(&mut self, n: usize) -> VmResult<&'a [u8]> {
        let data = self.data;
        let end = self
            .pos
            .checked_add(n)
            .filter(|&e| e <= data.len())
            .ok_or_else(|| {
                format!(
                    "truncated: {n} bytes of argument expected, {} left",
                    data.len() - self.pos
                )
            })?;
        let s = &data[self.pos..end];
        self.pos = end;
        Ok(s)
    }
    fn arr<const N: usize>(&mut self) -> VmResult<[u8; N]> {
        let mut a = [0u8; N];
        a.copy_from_slice(self.take(N)?);
        Ok(a)
    }
    fn len_u32(&mut self) -> VmResult<usize> {
        Ok(u32::from_le_bytes(self.arr()?) as usize)
    }
    fn len_u64(&mut self) -> VmResult<usize> {
        let n = u64::from_le_bytes(self.arr()?);
        usize::try_from(n).map_err(|_| format!("length {n} is too large"))
    }
    /// A newline-terminated argument (protocol 0 opcodes).
    fn line(&mut self) -> VmResult<&'a str> {
        let rest = &self.data[self.pos..];
        let n = rest
            .iter()
            .position(|&b| b == b'\n')
            .ok_or("truncated: no newline after a text argument")?;
        self.pos += n + 1;
        std::str::from_utf8(&rest[..n]).map_err(|_| "text argument is not UTF-8".to_string())
    }
    fn floor(&self) -> usize {
        self.marks.last().copied().unwrap_or(0)
    }
    fn pop(&mut self) -> VmResult<Value> {
        if self.stack.len() <= self.floor() {
            return Err("stack underflow".into());
        }
        self.stack.pop().ok_or_else(|| "stack underflow".into())
    }
    fn pop_n(&mut self, n: usize) -> VmResult<Vec<Value>> {
        if self.stack.len() < self.floor() + n {
            return Err(format!("stack underflow: {n} items needed"));
        }
        Ok(self.stack.split_off(self.stack.len() - n))
    }
    fn pop_mark(&mut self) -> VmResult<Vec<Value>> {
        let m = self.marks.pop().ok_or("no MARK on the stack")?;
        if m > self.stack.len() {
            return Err("the stack was popped below its MARK".into());
        }
        Ok(self.stack.split_off(m))
    }
    fn top(&self) -> VmResult<&Value> {
        if self.stack.len() <= self.floor() {
            return Err("stack underflow".into());
        }
        self.stack.last().ok_or_else(|| "stack underflow".into())
    }
    fn push(&mut self, v: Value) {
        self.stack.push(v);
    }
    fn put(&mut self, idx: u64) -> VmResult<()> {
        let v = self.top()?.clone();
        self.memo.insert(idx, v);
        Ok(())
    }
    fn get(&mut self, idx: u64) -> VmResult<()> {
        let v = self
            .memo
            .get(&idx)
            .cloned()
            .ok_or_else(|| format!("memo entry {idx} was never stored"))?;
        self.push(v);
        Ok(())
    }
    fn set_items(&mut self, items: Vec<Value>) -> VmResult<()> {
        if items.len() % 2 != 0 {
            return Err(format!(
                "SETITEMS needs key/value pairs, found {} items",
                items.len()
            ));
        }
        match self.top()? {
            Value::Dict(d) => {
                let mut d = d.borrow_mut();
                let mut it = items.into_iter();
                while let (Some(k), Some(v)) = (it.next(), it.next()) {
                    d.push((k, v)); // later duplicates win when the dict is read
                }
                Ok(())
            }
            Value::Opaque(_) => Ok(()), // e.g. a custom mapping we do not model
            other => Err(format!("cannot set items on {}", describe(other))),
        }
    }
    fn append(&mut self, items: Vec<Value>) -> VmResult<()> {
        match self.top()? {
            Value::List(l) => {
                l.borrow_mut().extend(items);
                Ok(())
            }
            Value::Opaque(_) => Ok(()),
            other => Err(format!("cannot append to {}", describe(other))),
        }
    }
    fn str(&mut self, bytes: &[u8]) {
        self.push(Value::Str(String::from_utf8_lossy(bytes).into()));
    }

    /// Run one opcode; `Some` at STOP.
    fn step(&mut self, op: u8) -> VmResult<Option<Value>> {
        let new_dict = |items: Vec<(Value, Value)>| Value::Dict(Rc::new(RefCell::new(items)));
        let new_list = |items: Vec<Value>| Value::List(Rc::new(RefCell::new(items)));
        match op {
            0x80 => drop(self.take(1)?), // PROTO: the opcodes themselves say what we need
            0x95 => drop(self.take(8)?), // FRAME: only a buffering hint
            b'.' => return self.pop().map(Some),
            b'(' => self.marks.push(self.stack.len()),
            b'}' => self.push(new_dict(Vec::new())),
            b']' | 0x8f => self.push(new_list(Vec::new())), // EMPTY_LIST, EMPTY_SET
            b')' => self.push(Value::Tuple(Rc::default())),
            b't' | 0x91 => {
                // TUPLE, FROZENSET
                let items = self.pop_mark()?;
                self.push(Value::Tuple(Rc::new(items)));
            }
            0x85..=0x87 => {
                let items = self.pop_n((op - 0x84) as usize)?;
                self.push(Value::Tuple(Rc::new(items)));
            }
            b'X' => {
                let n = self.len_u32()?;
                let s = self.take(n)?;
                let s = std::str::from_utf8(s).map_err(|_| "BINUNICODE string is not UTF-8")?;
                self.push(Value::Str(s.into()));
            }
            0x8c => {
                let n = self.arr::<1>()?[0] as usize;
                let s = self.take(n)?;
                let s =
                    std::str::from_utf8(s).map_err(|_| "SHORT_BINUNICODE string is not UTF-8")?;
                self.push(Value::Str(s.into()));
            }
            0x8d => {
                let n = self.len_u64()?;
                let s = self.take(n)?;
                let s = std::str::from_utf8(s).map_err(|_| "BINUNICODE8 string is not UTF-8")?;
                self.push(Value::Str(s.into()));
            }
            b'V' => {
                let s = raw_unicode_escape(self.line()?)?;
                self.push(Value::Str(s.into()));
            }
            b'T' => {
                let n = i32::from_le_bytes(self.arr()?);
                let n = usize::try_from(n).map_err(|_| format!("negative BINSTRING length {n}"))?;
                let s = self.take(n)?;
                self.str(s);
            }
            b'U' => {
                let n = self.arr::<1>()?[0] as usize;
                let s = self.take(n)?;
                self.str(s);
            }
            b'B' | b'C' | 0x8e => {
                let n = match op {
                    b'B' => self.len_u32()?,
                    b'C' => self.arr::<1>()?[0] as usize,
                    _ => self.len_u64()?,
                };
                self.take(n)?;
                self.push(Value::Bytes(n)); // raw bytes never matter for a state dict
            }
            b'J' => {
                let v = i32::from_le_bytes(self.arr()?);
                self.push(Value::Int(v.into()));
            }
            b'K' => {
                let v = self.arr::<1>()?[0];
                self.push(Value::Int(v.into()));
            }
            b'M' => {
                let v = u16::from_le_bytes(self.arr()?);
                self.push(Value::Int(v.into()));
            }
            b'I' | b'L' => {
                let s = self.line()?.trim();
                let v = match s {
                    "00" if op == b'I' => Value::Bool(false),
                    "01" if op == b'I' => Value::Bool(true),
                    _ => match s.trim_end_matches('L').parse::<i64>() {
                        Ok(i) => Value::Int(i),
                        Err(_)
                            if !s.is_empty()
                                && s.trim_end_matches('L')
                                    .bytes()
                                    .all(|b| b.is_ascii_digit() || b == b'-') =>
                        {
                            Value::Opaque("an integer wider than 64 bits".into())
                        }
                        Err(_) => return Err(format!("invalid integer {s:?}")),
                    },
                };
                self.push(v);
            }
            0x8a | 0x8b => {
                let n = if op == 0x8a {
                    self.arr::<1>()?[0] as usize
                } else {
                    let n = i32::from_le_bytes(self.arr()?);
                    usize::try_from(n).map_err(|_| format!("negative LONG4 length {n}"))?
                };
                let b = self.take(n)?;
                self.push(long_le(b));
            }
            b'G' => {
                let v = f64::from_be_bytes(self.arr()?);
                self.push(Value::Float(v));
            }
            b'F' => {
                let s = self.line()?.trim();
                let v = s
                    .parse::<f64>()
                    .map_err(|_| format!("invalid float {s:?}"))?;
                self.push(Value::Float(v));
            }
            b'N' => self.push(Value::None),
            0x88 => self.push(Value::Bool(true)),
            0x89 => self.push(Value::Bool(false)),
            b'c' => {
                let module = self.line()?.to_owned();
                let name = self.line()?.to_owned();
                self.push(Value::Global(Rc::new((module, name))));
            }
            0x93 => {
                let (name, module) = (self.pop()?, self.pop()?);
                let (Value::Str(module), Value::Str(name)) = (&module, &name) else {
                    return Err(format!(
                        "STACK_GLOBAL needs two strings, found {} and {}",
                        describe(&module),
                        describe(&name)
                    ));
                };
                self.push(Value::Global(Rc::new((
                    module.to_string(),
                    name.to_string(),
                ))));
            }
            b'R' | 0x81 => {
                // REDUCE: func(*args); NEWOBJ: cls.__new__(cls, *args), the same to us.
                let args = self.pop()?;
                let func = self.pop()?;
                self.push(call(&func, &args)?);
            }
            0x92 => {
                // NEWOBJ_EX: cls, args, kwargs
                let [cls, args, _kwargs] =
                    <[Value; 3]>::try_from(self.pop_n(3)?).map_err(|_| "stack underflow")?;
                self.push(call(&cls, &args)?);
            }
            b'b' => {
                // BUILD sets attributes (e.g. an OrderedDict's `_metadata`): nothing we need.
                self.pop()?;
                self.top()?;
            }
            b's' => {
                let items = self.pop_n(2)?;
                self.set_items(items)?;
            }
            b'u' => {
                let items = self.pop_mark()?;
                self.set_items(items)?;
            }
            b'a' => {
                let v = self.pop()?;
                self.append(vec![v])?;
            }
            b'e' | 0x90 => {
                // APPENDS, ADDITEMS
                let items = self.pop_mark()?;
                self.append(items)?;
            }
            b'q' | b'r' | b'p' | 0x94 | b'h' | b'j' | b'g' => {
                // PUT/GET in their three widths; MEMOIZE puts at the next free index.
                let idx: u64 = match op {
                    b'q' | b'h' => self.arr::<1>()?[0].into(),
                    b'r' | b'j' => u32::from_le_bytes(self.arr()?).into(),
                    b'p' | b'g' => {
                        let s = self.line()?.trim();
                        s.parse().map_err(|_| format!("invalid memo index {s:?}"))?
                    }
                    _ => self.memo.len() as u64,
                };
                if matches!(op, b'h' | b'j' | b'g') {
                    self.get(idx)?
                } else {
                    self.put(idx)?
                }
            }
            b'Q' => {
                let pid = self.pop()?;
                self.push(persistent_load(&pid)?);
            }
            b'P' => {
                let pid = Value::Str(self.line()?.into());
                self.push(persistent_load(&pid)?);
            }
            b'd' => {
                let items = self.pop_mark()?;
                if items.len() % 2 != 0 {
                    return Err(format!(
                        "DICT needs key/value pairs, found {} items",
                        items.len()
                    ));
                }
                let mut it = items.into_iter();
                let mut pairs = Vec::new();
                while let (Some(k), Some(v)) = (it.next(), it.next()) {
                    pairs.push((k, v));
                }
                self.push(new_dict(pairs));
            }
            b'l' => {
                let items = self.pop_mark()?;
                self.push(new_list(items));
            }
            b'0' => {
                // POP removes a MARK if that is what is on top.
                if self.marks.last() == Some(&self.stack.len()) {
                    self.marks.pop();
                } else {
                    self.pop()?;
                }
            }
            b'1' => drop(self.pop_mark()?),
            b'2' => {
                let v = self.top()?.clone();
                self.push(v);
            }
            _ => return Err(format!("unknown or unsupported pickle opcode 0x{op:02x}")),
        }
        Ok(None)
    }
}

/// A two's-complement little-endian integer (LONG1, LONG4).
fn long_le(b: &[u8]) -> Value {
    if b.len() > 8 {
        return Value::Opaque("an integer wider than 64 bits".into());
    }
    let fill = if b.last().is_some_and(|&x| x & 0x80 != 0) {
        0xff
    } else {
        0
    };
    let mut a = [fill; 8];
    a[..b.len()].copy_from_slice(b);
    Value::Int(i64::from_le_bytes(a))
}

/// Python's `raw-unicode-escape`: latin-1 text with `\uXXXX` and `\UXXXXXXXX` escapes.
fn raw_unicode_escape(s: &str) -> VmResult<String> {
    let b = s.as_bytes();
    let (mut out, mut i) = (String::new(), 0);
    while i < b.len() {
        if b[i] == b'\\' && matches!(b.get(i + 1), Some(b'u' | b'U')) {
            let n = if b[i + 1] == b'u' { 4 } else { 8 };
            let hex = s
                .get(i + 2..i + 2 + n)
                .ok_or("truncated \\u escape in UNICODE")?;
            let c = u32::from_str_radix(hex, 16).ok().and_then(char::from_u32);
            out.push(c.ok_or_else(|| format!("invalid escape \\u{hex} in UNICODE"))?);
            i += 2 + n;
        } else {
            out.push(b[i] as char);
            i += 1;
        }
    }
    Ok(out)
}

fn as_usize(v: &Value, what: &str) -> VmResult<usize> {
    match v {
        Value::Int(i) => {
            usize::try_from(*i).map_err(|_| format!("{what} must be a non-negative int, found {i}"))
        }
        other => Err(format!("{what} must be an int, found {}", describe(other))),
    }
}

fn usize_tuple(v: &Value, what: &str) -> VmResult<Vec<usize>> {
    match v {
        Value::Tuple(t) => t.iter().map(|x| as_usize(x, what)).collect(),
        other => Err(format!(
            "{what} must be a tuple of ints, found {}",
            describe(other)
        )),
    }
}

/// Apply a global to its arguments: only the few callables a state dict needs mean anything.
fn call(func: &Value, args: &Value) -> VmResult<Value> {
    let Value::Global(g) = func else {
        return Ok(Value::Opaque(
            format!("a call of {}", describe(func)).into(),
        ));
    };
    let empty = Vec::new();
    let args = match args {
        Value::Tuple(t) => t.as_slice(),
        _ => &empty,
    };
    let fname = format!("{}.{}", g.0, g.1);
    match fname.as_str() {
        // Filled in afterwards by SETITEMS.
        "collections.OrderedDict" => Ok(Value::Dict(Rc::default())),
        "torch._utils._rebuild_tensor_v2" | "torch._utils._rebuild_tensor" => {
            let [storage, offset, size, stride, ..] = args else {
                return Err(format!("{fname} needs (storage, storage_offset, size, stride, ...), found {} arguments", args.len()));
            };
            let Value::Storage(storage) = storage else {
                return Err(format!(
                    "{fname} needs a storage persistent id, found {}",
                    describe(storage)
                ));
            };
            let t = TensorRef {
                storage: storage.clone(),
                offset: as_usize(offset, "storage_offset")?,
                shape: usize_tuple(size, "size")?,
                stride: usize_tuple(stride, "stride")?,
            };
            if t.shape.len() != t.stride.len() {
                return Err(format!(
                    "{fname}: size {:?} and stride {:?} differ in length",
                    t.shape, t.stride
                ));
            }
            Ok(Value::Tensor(Rc::new(t)))
        }
        // A Parameter is its data tensor.
        "torch._utils._rebuild_parameter" | "torch._utils._rebuild_parameter_with_state" => {
            match args.first() {
                Some(t @ Value::Tensor(_)) => Ok(t.clone()),
                other => Err(format!(
                    "{fname} needs a tensor, found {}",
                    other.map_or("no argument".into(), describe)
                )),
            }
        }
        // Tensor subclasses: (func, type, args, state) → func(*args).
        "torch._tensor._rebuild_from_type_v2" => match args {
            [f, _, a, ..] => call(f, a),
            _ => Err(format!(
                "{fname} needs (func, type, args, state), found {} arguments",
                args.len()
            )),
        },
        _ => Ok(Value::Opaque(format!("{fname}(...)").into())),
    }
}

fn storage_dtype(type_name: &str) -> Option<DiskDType> {
    Some(match type_name {
        "torch.FloatStorage" => DiskDType::Float(DType::F32),
        "torch.BFloat16Storage" => DiskDType::Float(DType::BF16),
        "torch.HalfStorage" => DiskDType::Float(DType::F16),
        "torch.DoubleStorage" => DiskDType::Float(DType::F64),
        "torch.LongStorage" => DiskDType::I64,
        "torch.IntStorage" => DiskDType::I32,
        "torch.ShortStorage" => DiskDType::I16,
        "torch.CharStorage" => DiskDType::I8,
        "torch.ByteStorage" => DiskDType::U8,
        "torch.BoolStorage" => DiskDType::Bool,
        _ => return None,
    })
}

/// torch's persistent ids: `("storage", storage_type, key, location, numel)`.
fn persistent_load(pid: &Value) -> VmResult<Value> {
    let Value::Tuple(t) = pid else {
        return Ok(Value::Opaque(
            format!("persistent id {}", describe(pid)).into(),
        ));
    };
    match t.as_slice() {
        [Value::Str(tag), ty, key, _location, numel] if &**tag == "storage" => {
            let Value::Global(g) = ty else {
                return Err(format!(
                    "storage persistent id needs a storage type, found {}",
                    describe(ty)
                ));
            };
            let type_name = format!("{}.{}", g.0, g.1);
            let key = match key {
                Value::Str(s) => s.to_string(),
                Value::Int(i) => i.to_string(),
                other => {
                    return Err(format!(
                        "storage key must be a string, found {}",
                        describe(other)
                    ))
                }
            };
            let dtype = storage_dtype(&type_name);
            let numel = as_usize(numel, "storage numel")?;
            Ok(Value::Storage(Rc::new(Storage {
                type_name,
                dtype,
                key,
                numel,
            })))
        }
        _ => Ok(Value::Opaque(
            format!("persistent id {}", describe(pid)).into(),
        )),
    }
}

/// The (name, tensor) entries of the state dict: the top-level dict's tensors, or those of a
/// dict nested under "state_dict", "model" or "module". Non-tensor values are skipped.
fn select_state_dict(root: &Value) -> VmResult<Vec<(String, Rc<TensorRef>)>> {
    let Value::Dict(top) = root else {
        return Err(format!(
            "expected a dict of name → tensor (a state dict), found {}",
            describe(root)
        ));
    };
    let tensors_of = |v: &Value| -> Vec<(String, Rc<TensorRef>)> {
        let Value::Dict(d) = v else { return Vec::new() };
        let d = d.borrow();
        d.iter()
            .filter_map(|(k, v)| match (k, v) {
                (Value::Str(k), Value::Tensor(t)) => Some((k.to_string(), t.clone())),
                _ => None,
            })
            .collect()
    };
    let direct = tensors_of(root);
    if !direct.is_empty() || top.borrow().is_empty() {
        return Ok(direct);
    }
    for key in ["state_dict", "model", "module"] {
        let nested = top
            .borrow()
            .iter()
            .rev()
            .find(|(k, _)| matches!(k, Value::Str(s) if &**s == key))
            .map(|(_, v)| v.clone());
        if let Some(v) = nested {
            let t = tensors_of(&v);
            if !t.is_empty() {
                return Ok(t);
            }
        }
    }
    let keys: Vec<String> = top
        .borrow()
        .iter()
        .take(8)
        .map(|(k, _)| describe(k))
        .collect();
    Err(format!(
        "expected a state dict (name → tensor, at top level or under \"state_dict\", \"model\" or \"module\"), \
         found a dict without tensors whose keys include {}",
        keys.join(", ")
    ))
}

/// Copy a (possibly strided) view out of its storage's bytes, in row-major order.
fn materialise(
    name: &str,
    t: &TensorRef,
    entry: &str,
    bytes: &[u8],
) -> VmResult<(DiskDType, Vec<u8>)> {
    let st = &t.storage;
    let dtype = st.dtype.ok_or_else(|| {
        format!(
            "tensor `{name}` is stored as {}, which this reader does not support \
             (it reads Float, BFloat16, Half, Double, Long, Int, Short, Char, Byte and Bool storages)",
            st.type_name
        )
    })?;
    let es = dtype.size();
    let overflow = || {
        format!(
            "tensor `{name}`: shape {:?} with stride {:?} overflows",
            t.shape, t.stride
        )
    };
    let numel = t
        .shape
        .iter()
        .try_fold(1usize, |a, &s| a.checked_mul(s))
        .ok_or_else(overflow)?;
    if numel == 0 {
        return Ok((dtype, Vec::new()));
    }
    // One past the last element the view touches.
    let end = t
        .shape
        .iter()
        .zip(&t.stride)
        .try_fold(t.offset, |e, (&n, &s)| {
            e.checked_add((n - 1).checked_mul(s)?)
        })
        .and_then(|e| e.checked_add(1))
        .ok_or_else(overflow)?;
    let view = format!(
        "storage offset {}, shape {:?}, stride {:?}, {dtype}",
        t.offset, t.shape, t.stride
    );
    if end > st.numel {
        return Err(format!(
            "tensor `{name}` reads up to element {end} of storage `{}`, which holds {} elements ({view})",
            st.key, st.numel
        ));
    }
    let need = end.checked_mul(es).ok_or_else(overflow)?;
    if bytes.len() < need {
        return Err(format!(
            "zip entry `{entry}` holds {} bytes but tensor `{name}` needs {need} ({view})",
            bytes.len()
        ));
    }
    let el = |i: usize| &bytes[i * es..(i + 1) * es];
    // Row-major contiguous (dims of size 1 may carry any stride): one slice copy.
    let mut expect = 1;
    let contiguous = t.shape.iter().zip(&t.stride).rev().all(|(&n, &s)| {
        let ok = n == 1 || s == expect;
        expect *= n;
        ok
    });
    if contiguous {
        return Ok((
            dtype,
            bytes[t.offset * es..(t.offset + numel) * es].to_vec(),
        ));
    }
    // General case: walk indices like an odometer. All offsets are < `end`, checked above.
    let mut out = Vec::with_capacity(numel * es);
    let mut idx = vec![0usize; t.shape.len()];
    for _ in 0..numel {
        let off = t.offset + idx.iter().zip(&t.stride).map(|(i, s)| i * s).sum::<usize>();
        out.extend_from_slice(el(off));
        for d in (0..idx.len()).rev() {
            idx[d] += 1;
            if idx[d] < t.shape[d] {
                break;
            }
            idx[d] = 0;
        }
    }
    Ok((dtype, out))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::path::PathBuf;

    fn fixtures() -> PathBuf {
        let shared = Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/../shared/fixtures"));
        if shared.exists() {
            shared.to_path_buf()
        } else {
            Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
        }
    }

    fn st_dtype(d: safetensors::Dtype) -> DiskDType {
        match d {
            safetensors::Dtype::F32 => DiskDType::Float(DType::F32),
            safetensors::Dtype::BF16 => DiskDType::Float(DType::BF16),
            safetensors::Dtype::F16 => DiskDType::Float(DType::F16),
            safetensors::Dtype::I64 => DiskDType::I64,
            _ => DiskDType::Other,
        }
    }

    #[test]
    fn fixtures_match_safetensors() {
        for model in ["siso-tiny", "siso-mlp-norm"] {
            let dir = fixtures().join(model);
            let bin = read(&dir.join("pytorch_model.bin")).unwrap();
            let st_bytes = std::fs::read(dir.join("model.safetensors")).unwrap();
            let st = safetensors::SafeTensors::deserialize(&st_bytes).unwrap();
            assert_eq!(
                bin.len(),
                st.len() + usize::from(st.tensor("lm_head.weight").is_err()),
                "{model}"
            );
            for (name, t) in &bin {
                let Ok(s) = st.tensor(name) else {
                    assert_eq!(
                        name, "lm_head.weight",
                        "{model}: `{name}` not in the safetensors"
                    );
                    let emb = &bin["backbone.embedding.weight"];
                    assert_eq!(
                        (t.dtype, &t.shape, &t.bytes),
                        (emb.dtype, &emb.shape, &emb.bytes)
                    );
                    continue;
                };
                assert_eq!(t.dtype, st_dtype(s.dtype()), "{model} {name}");
                assert_eq!(t.shape, s.shape(), "{model} {name}");
                assert!(t.bytes[..] == *s.data(), "{model} {name}: bytes differ");
            }
        }
    }

    #[test]
    fn truncated_files_are_errors() {
        let full = std::fs::read(fixtures().join("siso-tiny/pytorch_model.bin")).unwrap();
        for len in [
            0,
            10,
            100,
            2100,
            full.len() / 2,
            full.len() - 10,
            full.len() - 1,
        ] {
            let mut f = tempfile::NamedTempFile::new().unwrap();
            f.write_all(&full[..len]).unwrap();
            assert!(read(f.path()).is_err(), "cut at {len}");
        }
    }

    // Hand-assembled pickles.
    fn s(x: &str) -> Vec<u8> {
        let mut v = vec![b'X'];
        v.extend((x.len() as u32).to_le_bytes());
        v.extend(x.as_bytes());
        v
    }
    fn tup(items: &[Vec<u8>]) -> Vec<u8> {
        let mut v = vec![b'('];
        items.iter().for_each(|i| v.extend(i));
        v.push(b't');
        v
    }
    fn ints(xs: &[u8]) -> Vec<u8> {
        tup(&xs.iter().map(|&x| vec![b'K', x]).collect::<Vec<_>>())
    }
    /// `_rebuild_tensor_v2(pid, offset, size, stride, False, OrderedDict())`
    fn tensor(ty: &str, key: &str, numel: u8, offset: u8, size: &[u8], stride: &[u8]) -> Vec<u8> {
        let mut v = b"ctorch._utils\n_rebuild_tensor_v2\n".to_vec();
        let mut pid = tup(&[
            s("storage"),
            format!("ctorch\n{ty}\n").into_bytes(),
            s(key),
            s("cpu"),
            vec![b'K', numel],
        ]);
        pid.push(b'Q');
        let dict = b"ccollections\nOrderedDict\n)R".to_vec();
        v.extend(tup(&[
            pid,
            vec![b'K', offset],
            ints(size),
            ints(stride),
            vec![0x89],
            dict,
        ]));
        v.push(b'R');
        v
    }
    fn dict(entries: &[(&str, Vec<u8>)]) -> Vec<u8> {
        let mut v = vec![b'}', b'('];
        for (k, val) in entries {
            v.extend(s(k));
            v.extend(val);
        }
        v.push(b'u');
        v
    }
    fn pickle(body: Vec<u8>) -> Vec<u8> {
        [vec![0x80, 2], body, vec![b'.']].concat()
    }
    fn zip_file(entries: &[(&str, &[u8])]) -> tempfile::NamedTempFile {
        let f = tempfile::NamedTempFile::new().unwrap();
        let mut z = zip::ZipWriter::new(f.reopen().unwrap());
        let opts = zip::write::SimpleFileOptions::default()
            .compression_method(zip::CompressionMethod::Stored);
        for (name, data) in entries {
            z.start_file(*name, opts).unwrap();
            z.write_all(data).unwrap();
        }
        z.finish().unwrap();
        f
    }
    fn f32s(t: &RawTensor) -> Vec<f32> {
        t.bytes
            .chunks(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect()
    }
    fn storage0() -> Vec<u8> {
        (0..10).flat_map(|i| (i as f32).to_le_bytes()).collect()
    }

    #[test]
    fn strided_views_offsets_and_oddities() {
        let mut t = tensor("FloatStorage", "0", 10, 1, &[2, 3], &[1, 2]);
        t.extend([b'q', 9]); // memoised, then reused below as a tied weight
        let mut param = b"ctorch._utils\n_rebuild_parameter\n".to_vec();
        param.extend(tup(&[
            tensor("FloatStorage", "0", 10, 2, &[2], &[3]),
            vec![0x88],
            b"ccollections\nOrderedDict\n)R".to_vec(),
        ]));
        param.push(b'R');
        let body = dict(&[
            ("t", t),
            ("scalar", tensor("FloatStorage", "0", 10, 9, &[], &[])),
            (
                "empty",
                tensor("FloatStorage", "0", 10, 0, &[0, 4], &[4, 1]),
            ),
            ("param", param),
            ("step", vec![b'K', 7]),
            ("ids", tensor("LongStorage", "1", 3, 0, &[3], &[1])),
            ("tied", vec![b'h', 9]),
        ]);
        // Nested one level, as training scripts save it.
        let body = [
            vec![b'}', b'('],
            s("epoch"),
            vec![b'K', 3],
            s("state_dict"),
            body,
            vec![b'u'],
        ]
        .concat();
        let ids: Vec<u8> = [10i64, 20, 30]
            .iter()
            .flat_map(|i| i.to_le_bytes())
            .collect();
        let f = zip_file(&[
            ("archive/data.pkl", &pickle(body)),
            ("archive/byteorder", b"little"),
            ("archive/data/0", &storage0()),
            ("archive/data/1", &ids),
        ]);
        let m = read(f.path()).unwrap();
        assert_eq!(
            m.keys().collect::<Vec<_>>(),
            ["empty", "ids", "param", "scalar", "t", "tied"]
        );
        assert_eq!(
            (m["t"].shape.clone(), f32s(&m["t"])),
            (vec![2, 3], vec![1., 3., 5., 2., 4., 6.])
        );
        assert_eq!(f32s(&m["tied"]), f32s(&m["t"]));
        assert_eq!(
            (m["scalar"].shape.clone(), f32s(&m["scalar"])),
            (vec![], vec![9.])
        );
        assert_eq!(
            (m["empty"].shape.clone(), m["empty"].bytes.len()),
            (vec![0, 4], 0)
        );
        assert_eq!(f32s(&m["param"]), [2., 5.]);
        assert_eq!(
            (m["ids"].dtype, &m["ids"].bytes[..]),
            (DiskDType::I64, &ids[..])
        );
    }

    fn read_err(pkl: &[u8], extra: &[(&str, &[u8])]) -> String {
        let mut entries = vec![("archive/data.pkl", pkl)];
        entries.extend_from_slice(extra);
        let f = zip_file(&entries);
        read(f.path()).map(|_| ()).unwrap_err().to_string()
    }

    #[test]
    fn malformed_pickles_are_errors() {
        let e = read_err(&[0x80, 2, b'}', 0xff, b'.'], &[]);
        assert!(e.contains("0xff") && e.contains("byte 3"), "{e}");
        for bad in [
            &[0x80, 2, b'R', b'.'][..],
            &[0x80, 2, b'h', 5, b'.'],
            &[0x80, 2, b'}'],
            &[0x80, 2, b'X', 9, 0, 0, 0, b'a'],
            &[b'(', b'0', b'0', b'.'],
        ] {
            let e = read_err(bad, &[]);
            assert!(e.contains("archive/data.pkl"), "{e}");
        }
        let e = read_err(&pickle(b"K\x07".to_vec()), &[]);
        assert!(e.contains("expected a dict"), "{e}");
    }

    #[test]
    fn bad_storage_and_archives_are_errors() {
        let data = storage0();
        let pkl = pickle(dict(&[(
            "w",
            tensor("FloatStorage", "0", 10, 8, &[4], &[1]),
        )]));
        let e = read_err(&pkl, &[("archive/data/0", &data)]);
        assert!(e.contains("holds 10 elements"), "{e}");
        let pkl = pickle(dict(&[(
            "w",
            tensor("FloatStorage", "0", 20, 8, &[4], &[1]),
        )]));
        let e = read_err(&pkl, &[("archive/data/0", &data)]);
        assert!(e.contains("holds 40 bytes but tensor `w` needs 48"), "{e}");
        let e = read_err(&pkl, &[]);
        assert!(e.contains("archive/data/0"), "{e}");
        let e = read_err(
            &pkl,
            &[("archive/byteorder", b"big"), ("archive/data/0", &data)],
        );
        assert!(e.contains("little"), "{e}");
        let f = zip_file(&[("archive/other", b"x")]);
        assert!(read(f.path()).unwrap_err().to_string().contains("data.pkl"));
    }
}
