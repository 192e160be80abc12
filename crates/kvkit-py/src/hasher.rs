//! `kvkit.BlockHasher`: kvblock's hashing, and extra keys from Python values.

use kvblock::{BlockSize, ExtraKeys};
use pyo3::exceptions::PyTypeError;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyBool, PyBytes, PyFloat, PyInt, PyList, PyString, PyTuple, PyType};

use crate::errors::Error;

/// Deepest nesting of tuples accepted in extra keys (deeper input is refused, not recursed).
const MAX_KEY_DEPTH: usize = 32;

/// `array.array`, imported once.
static ARRAY: PyOnceLock<Py<PyType>> = PyOnceLock::new();

/// Lists at least this long are read through `array.array("I", list)` (CPython's own loop,
/// about half the time of reading each item here).
const ARRAY_FROM: usize = 64;

/// Token ids from native-endian 4-byte integers.
fn from_ne_bytes(b: &[u8]) -> PyResult<Vec<u32>> {
    if b.len() % 4 != 0 {
        return Err(PyTypeError::new_err(format!(
            "token_ids as bytes must hold 4-byte ids (array('I').tobytes()); got {} bytes",
            b.len()
        )));
    }
    Ok(b.chunks_exact(4)
        .map(|c| u32::from_ne_bytes([c[0], c[1], c[2], c[3]]))
        .collect())
}

/// An `array.array` of typecode "I" (4-byte unsigned ints) as bytes, or None.
fn array_bytes<'py>(obj: &Bound<'py, PyAny>) -> PyResult<Option<Bound<'py, PyBytes>>> {
    let py = obj.py();
    let array = ARRAY.import(py, "array", "array")?;
    if !obj.is_instance(array)?
        || obj.getattr(intern!(py, "typecode"))?.extract::<String>()? != "I"
        || obj.getattr(intern!(py, "itemsize"))?.extract::<usize>()? != 4
    {
        return Ok(None);
    }
    Ok(Some(obj.call_method0(intern!(py, "tobytes"))?.cast_into()?))
}

/// Token ids from Python: a list (or any sequence) of ints, an `array.array("I")`, or bytes
/// of native-endian 4-byte ids. A value outside `0..2**32` raises OverflowError, a non-int
/// TypeError.
pub(crate) fn tokens(obj: &Bound<'_, PyAny>) -> PyResult<Vec<u32>> {
    let py = obj.py();
    if let Ok(list) = obj.cast::<PyList>() {
        if list.len() >= ARRAY_FROM {
            let array = ARRAY.import(py, "array", "array")?;
            let packed = array.call1((intern!(py, "I"), list))?;
            if let Some(b) = array_bytes(&packed)? {
                return from_ne_bytes(b.as_bytes());
            }
        }
        let mut out = Vec::with_capacity(list.len());
        for item in list.iter() {
            out.push(item.extract::<u32>()?);
        }
        return Ok(out);
    }
    if let Ok(b) = obj.cast::<PyBytes>() {
        return from_ne_bytes(b.as_bytes());
    }
    if let Some(b) = array_bytes(obj)? {
        return from_ne_bytes(b.as_bytes());
    }
    if obj.is_instance_of::<PyString>() {
        return Err(PyTypeError::new_err(
            "token_ids must be a sequence of ints, not str",
        ));
    }
    obj.extract::<Vec<u32>>()
}

fn push_value(keys: &mut ExtraKeys, v: &Bound<'_, PyAny>, depth: usize) -> Result<(), Error> {
    if v.is_none() {
        keys.push_nil();
    } else if let Ok(b) = v.cast::<PyBool>() {
        keys.push_bool(b.is_true());
    } else if v.is_instance_of::<PyInt>() {
        if let Ok(i) = v.extract::<i64>() {
            keys.push_int(i);
        } else if let Ok(u) = v.extract::<u64>() {
            keys.push_uint(u);
        } else {
            return Err(Error::ExtraKeys(
                "an integer outside -2**63..2**64".to_string(),
            ));
        }
    } else if let Ok(f) = v.cast::<PyFloat>() {
        keys.push_float(f.value());
    } else if let Ok(s) = v.cast::<PyString>() {
        let s = s
            .to_cow()
            .map_err(|e| Error::ExtraKeys(format!("a str that is not UTF-8: {e}")))?;
        keys.push_str(&s);
    } else if let Ok(b) = v.cast::<PyBytes>() {
        keys.push_bytes(b.as_bytes());
    } else if v.is_instance_of::<PyTuple>() || v.is_instance_of::<PyList>() {
        if depth >= MAX_KEY_DEPTH {
            return Err(Error::ExtraKeys(format!(
                "tuples nested deeper than {MAX_KEY_DEPTH}"
            )));
        }
        let mut inner = ExtraKeys::new();
        for item in v.try_iter().map_err(|e| Error::ExtraKeys(e.to_string()))? {
            let item = item.map_err(|e| Error::ExtraKeys(e.to_string()))?;
            push_value(&mut inner, &item, depth + 1)?;
        }
        keys.push_tuple(&inner);
    } else {
        let ty = v
            .get_type()
            .name()
            .map_or_else(|_| "?".to_string(), |n| n.to_string());
        return Err(Error::ExtraKeys(format!(
            "a value of type {ty}: expected str, bytes, int, float, bool, None or a tuple of them"
        )));
    }
    Ok(())
}

/// One `ExtraKeys` per block from a list (one entry per block) of lists of values.
pub(crate) fn extra_keys(obj: &Bound<'_, PyAny>) -> Result<Vec<ExtraKeys>, Error> {
    let mut out = Vec::new();
    let blocks = obj
        .try_iter()
        .map_err(|_| Error::ExtraKeys("expected a list with one list of keys per block".into()))?;
    for block in blocks {
        let block = block.map_err(|e| Error::ExtraKeys(e.to_string()))?;
        let mut keys = ExtraKeys::new();
        if !block.is_none() {
            if block.is_instance_of::<PyString>() || block.is_instance_of::<PyBytes>() {
                return Err(Error::ExtraKeys(
                    "each block's keys must be a list or tuple of values (or None)".into(),
                ));
            }
            let values = block.try_iter().map_err(|_| {
                Error::ExtraKeys("each block's keys must be a list or tuple of values".into())
            })?;
            for v in values {
                let v = v.map_err(|e| Error::ExtraKeys(e.to_string()))?;
                push_value(&mut keys, &v, 0)?;
            }
        }
        out.push(keys);
    }
    Ok(out)
}

/// A block size from Python, validated.
pub(crate) fn block_size(tokens: i64) -> Result<BlockSize, Error> {
    let n = usize::try_from(tokens).unwrap_or(0);
    Ok(BlockSize::new(n)?)
}

/// Hashes token ids into block hashes exactly as kvkit's router, its simulator and vLLM-style
/// engines keyed by kvblock do: XXH3-64 over each full block's tokens, chained (a block's hash
/// names its whole prefix). A partial tail is not hashed.
///
/// ```text
/// >>> kvkit.BlockHasher(16).hash(list(range(16)))
/// [15310707395893867146]
/// ```
#[pyclass(frozen, module = "kvkit")]
pub struct BlockHasher {
    size: BlockSize,
}

impl BlockHasher {
    fn hasher(&self, salt: Option<&str>, namespace: Option<&str>) -> kvblock::BlockHasher {
        kvblock::BlockHasher::new(self.size)
            .with_lora_name(salt.unwrap_or(""))
            .with_namespace(namespace.unwrap_or(""))
    }
}

#[pymethods]
impl BlockHasher {
    /// A hasher of `block_size` tokens per block (must equal the engines' --block-size).
    #[new]
    fn new(block_size: i64) -> PyResult<Self> {
        Ok(BlockHasher {
            size: block_size_or(block_size)?,
        })
    }

    /// Tokens per block.
    #[getter]
    fn block_size(&self) -> usize {
        self.size.get()
    }

    /// The sequence (chained) hash of every full block of `tokens` (ints, an
    /// `array.array("I")` or bytes of native-endian 4-byte ids), as unsigned 64-bit ints.
    /// `salt` is a LoRA adapter's name and `namespace` a cache namespace (both change the seed,
    /// so only requests with the same ones share blocks); `extra_keys` gives each block's
    /// extra keys (a list per block of str, bytes, int, float, bool, None or tuples of them),
    /// as vLLM keys multimodal blocks.
    #[pyo3(signature = (tokens, salt=None, extra_keys=None, *, namespace=None))]
    fn hash(
        &self,
        py: Python<'_>,
        tokens: &Bound<'_, PyAny>,
        salt: Option<String>,
        extra_keys: Option<&Bound<'_, PyAny>>,
        namespace: Option<String>,
    ) -> PyResult<Vec<u64>> {
        let toks = self::tokens(tokens)?;
        let keys = extra_keys.map(self::extra_keys).transpose()?;
        let h = self.hasher(salt.as_deref(), namespace.as_deref());
        let out = py.detach(|| match keys {
            Some(k) => h.sequence_hashes_keyed(&toks, &k),
            None => h.sequence_hashes(&toks),
        });
        Ok(out.into_iter().map(|b| b.get()).collect())
    }

    /// The local (content) hash of every full block of `tokens`, unchained.
    #[pyo3(signature = (tokens, salt=None, *, namespace=None))]
    fn local_hashes(
        &self,
        tokens: &Bound<'_, PyAny>,
        salt: Option<String>,
        namespace: Option<String>,
    ) -> PyResult<Vec<u64>> {
        let toks = self::tokens(tokens)?;
        let h = self.hasher(salt.as_deref(), namespace.as_deref());
        Ok(h.local_hashes(&toks).into_iter().map(|b| b.get()).collect())
    }

    fn __repr__(&self) -> String {
        format!("BlockHasher({})", self.size.get())
    }
}

fn block_size_or(tokens: i64) -> PyResult<BlockSize> {
    block_size(tokens).map_err(Into::into)
}
