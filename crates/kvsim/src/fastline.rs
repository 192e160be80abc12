//! The fast path of the Mooncake trace reader: a line of exactly the usual shape read byte by
//! byte (eight digits at a time), without building JSON values. Any other line goes to the
//! general path in `trace`, which reads it to the same values or to an error (a test checks).

/// Reads a line of exactly the Mooncake shape: one object with the four fields (in any order,
/// each once, no other), whole numbers without sign, fraction or exponent, JSON whitespace.
/// Returns (timestamp ms, input length, output length) with the ids in `ids`; `None` for any
/// other line, which the general path then reads (to the same values, or to an error).
pub(crate) fn fast_line(raw: &str, ids: &mut Vec<u64>) -> Option<(f64, usize, usize)> {
    let b = raw.as_bytes();
    let mut i = 0;
    let ws = |i: &mut usize| {
        while *i < b.len() && matches!(b[*i], b' ' | b'\t' | b'\n' | b'\r') {
            *i += 1;
        }
    };
    let num = |i: &mut usize| -> Option<u64> {
        let start = *i;
        // Eight bytes at once when there are eight: a number of 1 to 7 digits ends within them.
        let (mut n, mut end) = (0, start);
        if let Some(run) = b
            .get(start..start + 8)
            .and_then(|x| digits8(x.try_into().ok()?))
        {
            (n, end) = (run.0, start + run.1);
            if run.1 == 0 {
                return None;
            }
        }
        *i = end;
        while *i < b.len() && b[*i].is_ascii_digit() {
            // Wrapping: a literal too long for u64 is refused below, whatever it wrapped to.
            n = n.wrapping_mul(10).wrapping_add(u64::from(b[*i] - b'0'));
            *i += 1;
        }
        let len = *i - start;
        // No leading zero (not JSON), and few enough digits not to overflow.
        if len == 0 || len > 18 || (len > 1 && b[start] == b'0') {
            return None;
        }
        // A fraction or an exponent: not a whole number literal.
        if *i < b.len() && matches!(b[*i], b'.' | b'e' | b'E') {
            return None;
        }
        Some(n)
    };
    ws(&mut i);
    if b.get(i) != Some(&b'{') {
        return None;
    }
    i += 1;
    let (mut ts, mut input, mut output, mut have_ids) = (None, None, None, false);
    ids.clear();
    loop {
        ws(&mut i);
        if b.get(i) != Some(&b'"') {
            return None;
        }
        let key_start = i + 1;
        let key_end = key_start + b[key_start..].iter().position(|&c| c == b'"')?;
        let key = &b[key_start..key_end];
        i = key_end + 1;
        ws(&mut i);
        if b.get(i) != Some(&b':') {
            return None;
        }
        i += 1;
        ws(&mut i);
        let slot = match key {
            b"timestamp" => &mut ts,
            b"input_length" => &mut input,
            b"output_length" => &mut output,
            b"hash_ids" => {
                if std::mem::replace(&mut have_ids, true) || b.get(i) != Some(&b'[') {
                    return None;
                }
                i += 1;
                ws(&mut i);
                if b.get(i) == Some(&b']') {
                    i += 1;
                } else {
                    loop {
                        ids.push(num(&mut i)?);
                        ws(&mut i);
                        match b.get(i) {
                            Some(b',') => {
                                i += 1;
                                ws(&mut i);
                            }
                            Some(b']') => {
                                i += 1;
                                break;
                            }
                            _ => return None,
                        }
                    }
                }
                ws(&mut i);
                match b.get(i) {
                    Some(b',') => {
                        i += 1;
                        continue;
                    }
                    Some(b'}') => break,
                    _ => return None,
                }
            }
            _ => return None,
        };
        if slot.is_some() {
            return None;
        }
        *slot = Some(num(&mut i)?);
        ws(&mut i);
        match b.get(i) {
            Some(b',') => i += 1,
            Some(b'}') => break,
            _ => return None,
        }
    }
    i += 1;
    ws(&mut i);
    if i != b.len() || !have_ids {
        return None;
    }
    Some((
        ts? as f64,
        usize::try_from(input?).ok()?,
        usize::try_from(output?).ok()?,
    ))
}

/// The leading decimal digits of eight bytes, when fewer than eight: (their value, how many).
pub(crate) fn digits8(bytes: [u8; 8]) -> Option<(u64, usize)> {
    // Byte k is the k-th character; digits become 0..=9, and a byte is flagged when it is not
    // one (a carry from a flagged byte can only reach the bytes after it).
    let t = u64::from_le_bytes(bytes) ^ 0x3030_3030_3030_3030;
    let other = (t | t.wrapping_add(0x0606_0606_0606_0606)) & 0xF0F0_F0F0_F0F0_F0F0;
    if other == 0 {
        return None;
    }
    let len = (other.trailing_zeros() / 8) as usize;
    if len == 0 {
        return Some((0, 0));
    }
    // The digits moved to the last bytes, behind zeros, then combined pairwise: 2, 4, 8 digits.
    let v = t << (64 - 8 * len);
    let v = ((v & 0x0F00_0F00_0F00_0F00) >> 8) + (v & 0x000F_000F_000F_000F) * 10;
    let v = ((v & 0x00FF_0000_00FF_0000) >> 16) + (v & 0x0000_00FF_0000_00FF) * 100;
    let v = ((v & 0x0000_FFFF_0000_0000) >> 32) + (v & 0x0000_0000_0000_FFFF) * 10_000;
    Some((v, len))
}
