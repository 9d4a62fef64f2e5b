//! Core ML's weight file (`weights/weight.bin`, MIL blob storage version 2): a 64-byte header
//! (blob count, version), then per blob a 64-byte record at a 64-byte boundary (sentinel,
//! data type, size, offset of the data) followed by the data. A `const` op's
//! `blobFileValue.offset` names the record, not the data.

/// What every record starts with; a reader that does not find it rejects the file.
pub const SENTINEL: u32 = 0xDEAD_BEEF;
/// The storage format's version in the header.
pub const VERSION: u32 = 2;
/// Header, records and data all start at multiples of this.
pub const ALIGN: usize = 64;

/// A blob's element type, as the record names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u32)]
pub enum BlobType {
    F16 = 1,
    F32 = 2,
}

/// A weight file being written: blobs are appended, the header counts them.
pub struct WeightFile {
    bytes: Vec<u8>,
    count: u32,
}

impl Default for WeightFile {
    fn default() -> Self {
        Self::new()
    }
}

impl WeightFile {
    pub fn new() -> WeightFile {
        let mut bytes = vec![0u8; ALIGN];
        bytes[4..8].copy_from_slice(&VERSION.to_le_bytes());
        WeightFile { bytes, count: 0 }
    }

    /// Append `data` (`ty` elements, little-endian) and return its record's offset, the
    /// number a `blobFileValue` carries.
    pub fn push(&mut self, ty: BlobType, data: &[u8]) -> u64 {
        let record = self.bytes.len().next_multiple_of(ALIGN);
        let data_at = record + ALIGN;
        self.bytes.resize(data_at, 0);
        let r = &mut self.bytes[record..data_at];
        r[0..4].copy_from_slice(&SENTINEL.to_le_bytes());
        r[4..8].copy_from_slice(&(ty as u32).to_le_bytes());
        r[8..16].copy_from_slice(&(data.len() as u64).to_le_bytes());
        r[16..24].copy_from_slice(&(data_at as u64).to_le_bytes());
        self.bytes.extend_from_slice(data);
        self.count += 1;
        self.bytes[0..4].copy_from_slice(&self.count.to_le_bytes());
        record as u64
    }

    /// The file's bytes.
    pub fn into_bytes(self) -> Vec<u8> {
        self.bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn u32_at(b: &[u8], at: usize) -> u32 {
        u32::from_le_bytes(b[at..at + 4].try_into().unwrap())
    }

    fn u64_at(b: &[u8], at: usize) -> u64 {
        u64::from_le_bytes(b[at..at + 8].try_into().unwrap())
    }

    #[test]
    fn records_sit_on_64_byte_boundaries_and_point_at_their_data() {
        let mut w = WeightFile::new();
        let a = w.push(BlobType::F16, &[1, 2, 3, 4, 5, 6]);
        let b = w.push(BlobType::F32, &[9; 8]);
        let bytes = w.into_bytes();
        assert_eq!((u32_at(&bytes, 0), u32_at(&bytes, 4)), (2, VERSION));
        assert_eq!((a, b), (64, 192));
        for (at, ty, len) in [(a, 1, 6), (b, 2, 8)] {
            let at = at as usize;
            assert_eq!(u32_at(&bytes, at), SENTINEL);
            assert_eq!(u32_at(&bytes, at + 4), ty);
            assert_eq!(u64_at(&bytes, at + 8), len);
            let data = u64_at(&bytes, at + 16) as usize;
            assert_eq!(data, at + ALIGN);
            assert_eq!(bytes[data], if ty == 1 { 1 } else { 9 });
        }
        assert_eq!(bytes.len(), 192 + 64 + 8);
    }
}
