//! TensorBoard event files, written without TensorFlow: each scalar is an `Event` protocol
//! buffer (wall time, step, a `Summary` with one `simple_value`) framed as a TFRecord (length,
//! masked CRC-32C of the length, data, masked CRC-32C of the data), the format TensorBoard's
//! reader expects in `events.out.tfevents.*` files.

use std::io::Write;

use super::record::Record;

/// The scalars of one record, as (tag, value) at a step; what a TensorBoard user sees. An
/// evaluation's are the metrics its task declared, each `test/<name>`.
pub fn scalars(record: &Record) -> Vec<(String, f64)> {
    let evaluated = |metrics: &ddpjob_seam::MetricValues| {
        metrics
            .iter()
            .map(|(name, value)| (format!("test/{name}"), value))
            .collect::<Vec<_>>()
    };
    let named = |pairs: &[(&str, f64)]| {
        pairs
            .iter()
            .map(|&(tag, value)| (tag.to_string(), value))
            .collect::<Vec<_>>()
    };
    match record {
        Record::Train {
            loss,
            lr,
            samples_per_s,
            grad_norm,
            metrics,
            ..
        } => {
            let mut all = named(&[
                ("train/loss", *loss),
                ("train/lr", *lr),
                ("train/samples_per_s", *samples_per_s),
                ("train/grad_norm", grad_norm.unwrap_or(f64::NAN)),
            ]);
            all.extend(metrics.iter().map(|(name, v)| (format!("train/{name}"), v)));
            all
        }
        Record::Epoch { loss, metrics, .. } => {
            let mut all = named(&[("train/epoch_loss", *loss)]);
            all.extend(evaluated(metrics));
            all
        }
        Record::Eval { metrics, .. } => evaluated(metrics),
        Record::Resume { .. } => Vec::new(),
    }
    .into_iter()
    .filter(|(_, v)| v.is_finite())
    .collect()
}

/// The file's first event: its format version.
pub fn file_version_event(wall_time: f64) -> Vec<u8> {
    let mut event = Vec::new();
    event.push(0x09); // wall_time: field 1, 64-bit
    event.extend_from_slice(&wall_time.to_le_bytes());
    field_bytes(&mut event, 3, b"brain.Event:2");
    event
}

/// An event holding one scalar `tag` = `value` at `step`.
pub fn scalar_event(wall_time: f64, step: i64, tag: &str, value: f32) -> Vec<u8> {
    let mut summary_value = Vec::new();
    field_bytes(&mut summary_value, 1, tag.as_bytes()); // Summary.Value.tag
    summary_value.push(0x15); // simple_value: field 2, 32-bit
    summary_value.extend_from_slice(&value.to_le_bytes());
    let mut summary = Vec::new();
    field_bytes(&mut summary, 1, &summary_value); // Summary.value
    let mut event = Vec::new();
    event.push(0x09);
    event.extend_from_slice(&wall_time.to_le_bytes());
    event.push(0x10); // step: field 2, varint
    varint(&mut event, step as u64);
    field_bytes(&mut event, 5, &summary); // Event.summary
    event
}

/// Writes `data` as one TFRecord.
pub fn write_record(out: &mut impl Write, data: &[u8]) -> std::io::Result<()> {
    let len = (data.len() as u64).to_le_bytes();
    out.write_all(&len)?;
    out.write_all(&masked_crc(&len).to_le_bytes())?;
    out.write_all(data)?;
    out.write_all(&masked_crc(data).to_le_bytes())
}

fn field_bytes(out: &mut Vec<u8>, field: u64, bytes: &[u8]) {
    varint(out, (field << 3) | 2);
    varint(out, bytes.len() as u64);
    out.extend_from_slice(bytes);
}

fn varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

fn masked_crc(data: &[u8]) -> u32 {
    let crc = crc32c(data);
    crc.rotate_right(15).wrapping_add(0xa282_ead8)
}

/// CRC-32C (Castagnoli), bit-reflected, as TFRecord uses.
fn crc32c(data: &[u8]) -> u32 {
    static TABLE: std::sync::OnceLock<[u32; 256]> = std::sync::OnceLock::new();
    let table = TABLE.get_or_init(|| {
        let mut table = [0u32; 256];
        for (i, slot) in table.iter_mut().enumerate() {
            let mut c = i as u32;
            for _ in 0..8 {
                c = if c & 1 != 0 {
                    0x82F6_3B78 ^ (c >> 1)
                } else {
                    c >> 1
                };
            }
            *slot = c;
        }
        table
    });
    !data.iter().fold(!0u32, |c, &b| {
        table[((c ^ b as u32) & 0xff) as usize] ^ (c >> 8)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crc32c_and_record_framing_match_the_format() {
        // The CRC-32C check value (RFC 3720 and every implementation's test vector).
        assert_eq!(crc32c(b"123456789"), 0xE306_9283);
        let mut out = Vec::new();
        write_record(&mut out, b"abc").unwrap();
        assert_eq!(out.len(), 8 + 4 + 3 + 4);
        assert_eq!(&out[..8], &3u64.to_le_bytes());
        assert_eq!(&out[12..15], b"abc");
        assert_eq!(&out[15..], &masked_crc(b"abc").to_le_bytes());
    }

    #[test]
    fn a_scalar_event_encodes_its_fields() {
        let event = scalar_event(1.5, 300, "train/loss", 0.25);
        assert_eq!(event[0], 0x09);
        assert_eq!(&event[1..9], &1.5f64.to_le_bytes());
        // step 300 as a varint: 0xAC 0x02.
        assert_eq!(&event[9..12], &[0x10, 0xAC, 0x02]);
        assert_eq!(event[12], 0x2A); // summary, length-delimited
        let tail = &event[event.len() - 5..];
        assert_eq!(tail[0], 0x15);
        assert_eq!(&tail[1..], &0.25f32.to_le_bytes());
    }
}
