//! The field names of a serde struct, read from its `Deserialize` impl: serde passes them to
//! `deserialize_struct`, so a deserializer that records them and stops learns them without a
//! value. This is how a user's options struct gets unknown-key errors with a did-you-mean.

use serde::de::{self, Deserialize, Deserializer, Visitor};

/// The fields `T` deserialises from when it is a struct (renames applied; a struct without
/// fields has none); `None` otherwise (a map takes any key, so nothing is refused).
pub fn struct_fields<'de, T: Deserialize<'de>>() -> Option<&'static [&'static str]> {
    let mut fields = None;
    let _ = T::deserialize(FieldsOnly {
        fields: &mut fields,
    });
    fields
}

struct FieldsOnly<'a> {
    fields: &'a mut Option<&'static [&'static str]>,
}

#[derive(Debug)]
struct Stop;

impl std::fmt::Display for Stop {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("field names read")
    }
}

impl std::error::Error for Stop {}

impl de::Error for Stop {
    fn custom<M: std::fmt::Display>(_: M) -> Self {
        Stop
    }
}

impl<'de> Deserializer<'de> for FieldsOnly<'_> {
    type Error = Stop;

    fn deserialize_any<V: Visitor<'de>>(self, _: V) -> Result<V::Value, Stop> {
        Err(Stop)
    }

    fn deserialize_struct<V: Visitor<'de>>(
        self,
        _name: &'static str,
        fields: &'static [&'static str],
        _visitor: V,
    ) -> Result<V::Value, Stop> {
        *self.fields = Some(fields);
        Err(Stop)
    }

    serde::forward_to_deserialize_any! {
        bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string bytes byte_buf
        option unit unit_struct newtype_struct seq tuple tuple_struct map enum identifier
        ignored_any
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde::Deserialize;

    #[derive(Deserialize)]
    #[allow(dead_code)]
    struct Options {
        width: usize,
        #[serde(rename = "depth_of_net")]
        depth: usize,
        #[serde(default)]
        dropout: f64,
    }

    #[test]
    fn reads_a_structs_field_names_with_renames() {
        assert_eq!(
            struct_fields::<Options>(),
            Some(&["width", "depth_of_net", "dropout"][..])
        );
    }

    #[derive(Deserialize)]
    struct Nothing {}

    #[test]
    fn a_map_has_no_fixed_fields_and_an_empty_struct_has_none() {
        assert!(struct_fields::<std::collections::BTreeMap<String, i64>>().is_none());
        assert_eq!(struct_fields::<Nothing>(), Some(&[][..]));
    }
}
