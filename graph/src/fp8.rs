//! The two FP8 formats of Hopper's tensor cores (OCP 8-bit floating point, NVIDIA's
//! `__nv_fp8_e4m3` and `__nv_fp8_e5m2`): their values and the saturating conversion to
//! them that the GPU's `cvt.rn.satfinite` performs, so that a CPU reference rounds as
//! the kernels do, bit for bit.
//!
//! - E4M3: 4 exponent bits (bias 7), 3 mantissa bits, no infinities, NaN `S.1111.111`;
//!   largest finite 448, smallest subnormal 2^-9. Forward activations and weights.
//! - E5M2: 5 exponent bits (bias 15), 2 mantissa bits, IEEE-like infinities and NaNs;
//!   largest finite 57344, smallest subnormal 2^-16. Gradients.
//!
//! Conversion ([`Fp8::encode`]) is `cuda_fp8.hpp`'s `__nv_cvt_float_to_fp8(x,
//! __NV_SATFINITE, ...)`: round to nearest, ties to even; magnitudes beyond the largest
//! finite value (infinities included) saturate to it, keeping the sign; a NaN becomes
//! `0x7F`; below half the smallest subnormal, a zero of the input's sign.

/// An FP8 format.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Fp8 {
    E4M3,
    E5M2,
}

/// The code every NaN converts to.
pub const NAN_CODE: u8 = 0x7F;

impl Fp8 {
    /// The format of an FP8 dtype; `None` for the others.
    pub fn of(dtype: crate::DType) -> Option<Fp8> {
        match dtype {
            crate::DType::F8E4M3 => Some(Fp8::E4M3),
            crate::DType::F8E5M2 => Some(Fp8::E5M2),
            _ => None,
        }
    }

    pub const fn mantissa_bits(self) -> u32 {
        match self {
            Fp8::E4M3 => 3,
            Fp8::E5M2 => 2,
        }
    }

    pub const fn exponent_bias(self) -> i32 {
        match self {
            Fp8::E4M3 => 7,
            Fp8::E5M2 => 15,
        }
    }

    /// The code of the largest finite value.
    pub const fn max_code(self) -> u8 {
        match self {
            Fp8::E4M3 => 0x7E,
            Fp8::E5M2 => 0x7B,
        }
    }

    /// The largest finite value: 448 or 57344.
    pub fn max(self) -> f32 {
        self.decode(self.max_code())
    }

    /// The value of `code`.
    pub fn decode(self, code: u8) -> f32 {
        let m = self.mantissa_bits();
        let magnitude = code & 0x7F;
        let (exponent, mantissa) = (
            i32::from(magnitude >> m),
            u32::from(magnitude) & ((1 << m) - 1),
        );
        let top = (1u8 << (7 - m)) - 1;
        let value = match self {
            Fp8::E4M3 if magnitude == 0x7F => f32::NAN,
            Fp8::E5M2 if exponent == i32::from(top) && mantissa != 0 => f32::NAN,
            Fp8::E5M2 if exponent == i32::from(top) => f32::INFINITY,
            _ if exponent == 0 => mantissa as f32 * pow2(1 - self.exponent_bias() - m as i32),
            _ => {
                let significand = ((1u32 << m) + mantissa) as f32;
                significand * pow2(exponent - self.exponent_bias() - m as i32)
            }
        };
        if code & 0x80 != 0 {
            -value
        } else {
            value
        }
    }

    /// `x` rounded to the format, saturating, as the GPU converts it (see the module).
    pub fn encode(self, x: f32) -> u8 {
        if x.is_nan() {
            return NAN_CODE;
        }
        let sign = if x.is_sign_negative() { 0x80 } else { 0 };
        let a = f64::from(x.abs());
        let m = self.mantissa_bits() as i32;
        let min_exponent = 1 - self.exponent_bias();
        // The binade of `a` (the smallest normal one for subnormals), from the bits of
        // the f64: exact, unlike a logarithm.
        let exponent = if a >= f64::from(pow2(min_exponent)) {
            ((a.to_bits() >> 52) & 0x7FF) as i32 - 1023
        } else {
            min_exponent
        };
        // The significand in units of the binade's last place, rounded: `a` is an f32
        // and the unit a power of two, so the division is exact.
        let units = (a / f64::from(pow2(exponent - m))).round_ties_even();
        let one = f64::from(1u32 << m);
        let code = if units < one {
            units as u32
        } else if units >= 2.0 * one {
            ((exponent + self.exponent_bias() + 1) as u32) << m
        } else {
            (((exponent + self.exponent_bias()) as u32) << m) + (units - one) as u32
        };
        let code = if a.is_infinite() {
            self.max_code()
        } else {
            code.min(u32::from(self.max_code())) as u8
        };
        code | sign
    }
}

/// A value of an FP8 format: its code. Equality and order are the values' (so `-0 ==
/// 0` and NaN equals nothing), as for the other float types.
macro_rules! fp8_value {
    ($name:ident, $format:expr) => {
        #[doc = concat!("A value of ", stringify!($format), ".")]
        #[derive(Clone, Copy, Debug, Default, serde::Serialize, serde::Deserialize)]
        #[repr(transparent)]
        pub struct $name(pub u8);

        impl $name {
            pub const FORMAT: Fp8 = $format;

            pub fn from_f32(x: f32) -> Self {
                $name(Self::FORMAT.encode(x))
            }

            pub fn to_f32(self) -> f32 {
                Self::FORMAT.decode(self.0)
            }

            pub fn is_finite(self) -> bool {
                self.to_f32().is_finite()
            }
        }

        impl PartialEq for $name {
            fn eq(&self, other: &Self) -> bool {
                self.to_f32() == other.to_f32()
            }
        }

        impl PartialOrd for $name {
            fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
                self.to_f32().partial_cmp(&other.to_f32())
            }
        }
    };
}

fp8_value!(F8E4M3, Fp8::E4M3);
fp8_value!(F8E5M2, Fp8::E5M2);

/// 2^e as an f32 (`e` within f32's normal exponents or a little below).
fn pow2(e: i32) -> f32 {
    2f32.powi(e)
}

/// The largest magnitude of `values` (an FP8 scale's amax): NaN where one is NaN
/// (`f32::max` would skip it), infinite where one is, 0 for none.
pub fn amax(values: &[f32]) -> f32 {
    values.iter().fold(0f32, |m, v| {
        if v.is_nan() || m.is_nan() {
            f32::NAN
        } else {
            m.max(v.abs())
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const FORMATS: [Fp8; 2] = [Fp8::E4M3, Fp8::E5M2];

    #[test]
    fn the_formats_hold_their_documented_values() {
        let e4 = Fp8::E4M3;
        assert_eq!(e4.max(), 448.0);
        assert_eq!(e4.decode(0x01), 2f32.powi(-9));
        assert_eq!(e4.decode(0x08), 2f32.powi(-6));
        assert_eq!(e4.decode(0x38), 1.0);
        assert_eq!(e4.decode(0x39), 1.125);
        assert!(e4.decode(0x7F).is_nan() && e4.decode(0xFF).is_nan());
        assert_eq!(e4.decode(0xFE), -448.0);
        let e5 = Fp8::E5M2;
        assert_eq!(e5.max(), 57344.0);
        assert_eq!(e5.decode(0x01), 2f32.powi(-16));
        assert_eq!(e5.decode(0x3C), 1.0);
        assert_eq!(e5.decode(0x3D), 1.25);
        assert_eq!(e5.decode(0x7C), f32::INFINITY);
        assert_eq!(e5.decode(0xFC), f32::NEG_INFINITY);
        assert!(e5.decode(0x7D).is_nan() && e5.decode(0x7F).is_nan());
        for f in FORMATS {
            assert_eq!(f.decode(0x80).to_bits(), (-0.0f32).to_bits());
        }
    }

    /// The float64 reference: the nearest finite value of the format by brute force
    /// over its codes (ties to the even code), saturating at the largest; NaN to
    /// 0x7F; zeros keep the input's sign.
    fn reference(f: Fp8, x: f32) -> u8 {
        if x.is_nan() {
            return NAN_CODE;
        }
        let sign = if x.is_sign_negative() { 0x80 } else { 0 };
        let a = f64::from(x.abs());
        if a >= f64::from(f.max()) {
            return f.max_code() | sign;
        }
        let mut best = (f64::INFINITY, 0u8);
        for code in 0..=f.max_code() {
            let d = (f64::from(f.decode(code)) - a).abs();
            let better = d < best.0 || (d == best.0 && code % 2 == 0);
            if better {
                best = (d, code);
            }
        }
        best.1 | sign
    }

    #[test]
    fn every_finite_code_converts_back_to_itself() {
        for f in FORMATS {
            for code in 0..=255u8 {
                let v = f.decode(code);
                if v.is_finite() {
                    assert_eq!(f.encode(v), code, "{f:?} {code:#04x} ({v})");
                }
            }
        }
    }

    /// Every midpoint between neighbouring values (the ties), a value just either side
    /// of each, values past the largest and infinities, and 200,000 values spread
    /// over f32's bits: the conversion equals the reference.
    #[test]
    fn conversion_rounds_to_nearest_even_and_saturates_as_the_reference() {
        for f in FORMATS {
            let mut xs: Vec<f32> = Vec::new();
            let values: Vec<f32> = (0..=f.max_code()).map(|c| f.decode(c)).collect();
            for pair in values.windows(2) {
                let mid = (pair[0] + pair[1]) / 2.0;
                xs.extend([mid, next_up(mid), next_down(mid), pair[0], pair[1]]);
            }
            let max = f.max();
            xs.extend([max * 1.01, max * 4.0, f32::MAX, f32::INFINITY, 1e-30, 0.0]);
            let mut bits = 0x1234_5678u32;
            for _ in 0..200_000 {
                bits ^= bits << 13;
                bits ^= bits >> 17;
                bits ^= bits << 5;
                xs.push(f32::from_bits(bits));
            }
            for x in xs {
                for x in [x, -x] {
                    assert_eq!(
                        f.encode(x),
                        reference(f, x),
                        "{f:?} {x:e} ({:#010x})",
                        x.to_bits()
                    );
                }
            }
            assert_eq!(f.encode(f32::NAN), NAN_CODE);
            assert_eq!(f.encode(-f32::NAN), NAN_CODE);
            assert_eq!(f.encode(f32::NEG_INFINITY), f.max_code() | 0x80);
        }
    }

    fn next_up(x: f32) -> f32 {
        f32::from_bits(x.to_bits() + 1)
    }

    fn next_down(x: f32) -> f32 {
        if x == 0.0 {
            x
        } else {
            f32::from_bits(x.to_bits() - 1)
        }
    }
}
