//! GGUF metadata values: the thirteen value types of the format, arrays kept
//! typed (a vocabulary of 150 000 strings is one `Vec<String>`, scores one
//! `Vec<f32>`) so that accessors can hand out slices without copying.

use std::fmt;

/// A GGUF value type id (`gguf_type` in ggml, `GGUFValueType` in gguf-py).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum GgufValueType {
    U8,
    I8,
    U16,
    I16,
    U32,
    I32,
    F32,
    Bool,
    String,
    Array,
    U64,
    I64,
    F64,
}

impl GgufValueType {
    /// Every type, indexed by its id.
    pub const ALL: [GgufValueType; 13] = [
        Self::U8,
        Self::I8,
        Self::U16,
        Self::I16,
        Self::U32,
        Self::I32,
        Self::F32,
        Self::Bool,
        Self::String,
        Self::Array,
        Self::U64,
        Self::I64,
        Self::F64,
    ];

    pub fn from_id(id: u32) -> Option<Self> {
        Self::ALL.get(id as usize).copied()
    }

    pub fn id(self) -> u32 {
        Self::ALL.iter().position(|t| *t == self).unwrap_or(0) as u32
    }

    /// Bytes one value of a fixed-size type takes; `None` for strings and
    /// arrays, whose size is in the file.
    pub fn fixed_size(self) -> Option<usize> {
        match self {
            Self::U8 | Self::I8 | Self::Bool => Some(1),
            Self::U16 | Self::I16 => Some(2),
            Self::U32 | Self::I32 | Self::F32 => Some(4),
            Self::U64 | Self::I64 | Self::F64 => Some(8),
            Self::String | Self::Array => None,
        }
    }

    /// The fewest bytes one value can take in a file: what bounds a count
    /// read from a hostile file before anything is allocated for it.
    pub fn min_size(self) -> usize {
        match self {
            Self::String => 8,    // u64 length
            Self::Array => 4 + 8, // element type, u64 count
            _ => self.fixed_size().unwrap_or(1),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::U8 => "u8",
            Self::I8 => "i8",
            Self::U16 => "u16",
            Self::I16 => "i16",
            Self::U32 => "u32",
            Self::I32 => "i32",
            Self::F32 => "f32",
            Self::Bool => "bool",
            Self::String => "string",
            Self::Array => "array",
            Self::U64 => "u64",
            Self::I64 => "i64",
            Self::F64 => "f64",
        }
    }
}

impl fmt::Display for GgufValueType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// One metadata value.
#[derive(Clone, PartialEq, Debug)]
pub enum GgufValue {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    String(String),
    Array(GgufArray),
    U64(u64),
    I64(i64),
    F64(f64),
}

/// A metadata array: all elements of one type, possibly arrays themselves.
#[derive(Clone, PartialEq, Debug)]
pub enum GgufArray {
    U8(Vec<u8>),
    I8(Vec<i8>),
    U16(Vec<u16>),
    I16(Vec<i16>),
    U32(Vec<u32>),
    I32(Vec<i32>),
    F32(Vec<f32>),
    Bool(Vec<bool>),
    String(Vec<String>),
    /// Nested arrays (GGUF allows them; llama.cpp writes none today).
    Array(Vec<GgufArray>),
    U64(Vec<u64>),
    I64(Vec<i64>),
    F64(Vec<f64>),
}

impl GgufValue {
    pub fn value_type(&self) -> GgufValueType {
        match self {
            Self::U8(_) => GgufValueType::U8,
            Self::I8(_) => GgufValueType::I8,
            Self::U16(_) => GgufValueType::U16,
            Self::I16(_) => GgufValueType::I16,
            Self::U32(_) => GgufValueType::U32,
            Self::I32(_) => GgufValueType::I32,
            Self::F32(_) => GgufValueType::F32,
            Self::Bool(_) => GgufValueType::Bool,
            Self::String(_) => GgufValueType::String,
            Self::Array(_) => GgufValueType::Array,
            Self::U64(_) => GgufValueType::U64,
            Self::I64(_) => GgufValueType::I64,
            Self::F64(_) => GgufValueType::F64,
        }
    }

    /// The value as an unsigned integer, when it is an integer of any width
    /// that is not negative: writers disagree on widths (gguf-py writes
    /// `llama.context_length` as u32, other tools as u64 or i32).
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Self::U8(v) => Some(v.into()),
            Self::U16(v) => Some(v.into()),
            Self::U32(v) => Some(v.into()),
            Self::U64(v) => Some(v),
            Self::I8(v) => u64::try_from(v).ok(),
            Self::I16(v) => u64::try_from(v).ok(),
            Self::I32(v) => u64::try_from(v).ok(),
            Self::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    /// The value as a float, when it is a float or an integer.
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Self::F32(v) => Some(v.into()),
            Self::F64(v) => Some(v),
            Self::I8(v) => Some(v.into()),
            Self::I16(v) => Some(v.into()),
            Self::I32(v) => Some(v.into()),
            Self::I64(v) => Some(v as f64),
            _ => self.as_u64().map(|v| v as f64),
        }
    }

    /// A short description of the type for error messages
    /// (`array of string`, `u32`).
    pub fn type_name(&self) -> String {
        match self {
            Self::Array(a) => format!("array of {}", a.type_name()),
            v => v.value_type().name().to_string(),
        }
    }
}

impl GgufArray {
    pub fn elem_type(&self) -> GgufValueType {
        match self {
            Self::U8(_) => GgufValueType::U8,
            Self::I8(_) => GgufValueType::I8,
            Self::U16(_) => GgufValueType::U16,
            Self::I16(_) => GgufValueType::I16,
            Self::U32(_) => GgufValueType::U32,
            Self::I32(_) => GgufValueType::I32,
            Self::F32(_) => GgufValueType::F32,
            Self::Bool(_) => GgufValueType::Bool,
            Self::String(_) => GgufValueType::String,
            Self::Array(_) => GgufValueType::Array,
            Self::U64(_) => GgufValueType::U64,
            Self::I64(_) => GgufValueType::I64,
            Self::F64(_) => GgufValueType::F64,
        }
    }

    pub fn len(&self) -> usize {
        match self {
            Self::U8(v) => v.len(),
            Self::I8(v) => v.len(),
            Self::U16(v) => v.len(),
            Self::I16(v) => v.len(),
            Self::U32(v) => v.len(),
            Self::I32(v) => v.len(),
            Self::F32(v) => v.len(),
            Self::Bool(v) => v.len(),
            Self::String(v) => v.len(),
            Self::Array(v) => v.len(),
            Self::U64(v) => v.len(),
            Self::I64(v) => v.len(),
            Self::F64(v) => v.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// An empty array of element type `ty`.
    pub fn empty(ty: GgufValueType) -> Self {
        match ty {
            GgufValueType::U8 => Self::U8(Vec::new()),
            GgufValueType::I8 => Self::I8(Vec::new()),
            GgufValueType::U16 => Self::U16(Vec::new()),
            GgufValueType::I16 => Self::I16(Vec::new()),
            GgufValueType::U32 => Self::U32(Vec::new()),
            GgufValueType::I32 => Self::I32(Vec::new()),
            GgufValueType::F32 => Self::F32(Vec::new()),
            GgufValueType::Bool => Self::Bool(Vec::new()),
            GgufValueType::String => Self::String(Vec::new()),
            GgufValueType::Array => Self::Array(Vec::new()),
            GgufValueType::U64 => Self::U64(Vec::new()),
            GgufValueType::I64 => Self::I64(Vec::new()),
            GgufValueType::F64 => Self::F64(Vec::new()),
        }
    }

    pub fn type_name(&self) -> String {
        match self {
            Self::Array(items) => match items.first() {
                Some(inner) => format!("array of {}", inner.type_name()),
                None => "array".to_string(),
            },
            a => a.elem_type().name().to_string(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_round_trip() {
        for (id, ty) in GgufValueType::ALL.iter().enumerate() {
            assert_eq!(GgufValueType::from_id(id as u32), Some(*ty));
            assert_eq!(ty.id(), id as u32);
            assert_eq!(GgufArray::empty(*ty).elem_type(), *ty);
        }
        assert_eq!(GgufValueType::from_id(13), None);
    }

    #[test]
    fn integer_widths_widen_and_negatives_do_not() {
        assert_eq!(GgufValue::U32(7).as_u64(), Some(7));
        assert_eq!(GgufValue::I32(7).as_u64(), Some(7));
        assert_eq!(GgufValue::I64(-1).as_u64(), None);
        assert_eq!(GgufValue::F32(1.0).as_u64(), None);
        assert_eq!(GgufValue::U8(2).as_f64(), Some(2.0));
        let nested = GgufValue::Array(GgufArray::Array(vec![GgufArray::F32(vec![1.0])]));
        assert_eq!(nested.type_name(), "array of array of f32");
    }
}
