// numpy's `np.random.default_rng(seed).standard_normal(shape, dtype=np.float32)`, bit for bit, so the page
// draws the latents and noise `onnxdiffusion generate` draws for a seed. Three parts, each as numpy defines it:
// SeedSequence (seed -> 128-bit PCG64 state and increment), PCG64 (128-bit LCG, XSL-RR output, the 64-bit
// output split into two 32-bit draws, low half first), and the float32 ziggurat (256 layers, 23-bit
// magnitudes) with its tail and wedge paths. Float32 arithmetic is rounded after every operation
// (Math.fround), as C evaluates float expressions on x86-64.

const MASK128 = (1n << 128n) - 1n;
const MASK64 = (1n << 64n) - 1n;
const PCG_MULT = (2549297995355413924n << 64n) | 4865540595714422341n;

// SeedSequence constants (numpy/random/bit_generator.pyx)
const INIT_A = 0x43b0d7e5, MULT_A = 0x931e8875, INIT_B = 0x8b51f9dd, MULT_B = 0x58f38ded;
const MIX_MULT_L = 0xca01f9dd, MIX_MULT_R = 0x4973f715;

function seedWords(seed) {
  // a non-negative integer -> uint32 words, lowest first (0 -> [0])
  let n = BigInt(seed);
  if (n < 0n) throw new Error("seed must be a non-negative integer");
  const words = [];
  if (n === 0n) words.push(0);
  while (n > 0n) { words.push(Number(n & 0xffffffffn)); n >>= 32n; }
  return words;
}

function seedSequenceState(seed) {
  // SeedSequence(seed).generate_state(4, uint64) as four BigInts
  const entropy = seedWords(seed);
  const pool = [0, 0, 0, 0];
  let hashConst = INIT_A;
  const hashmix = (value) => {
    value = (value ^ hashConst) >>> 0;
    hashConst = Math.imul(hashConst, MULT_A) >>> 0;
    value = Math.imul(value, hashConst) >>> 0;
    return (value ^ (value >>> 16)) >>> 0;
  };
  const mix = (x, y) => {
    const r = (Math.imul(MIX_MULT_L, x) - Math.imul(MIX_MULT_R, y)) >>> 0;
    return (r ^ (r >>> 16)) >>> 0;
  };
  for (let i = 0; i < 4; i++) pool[i] = hashmix(i < entropy.length ? entropy[i] : 0);
  for (let src = 0; src < 4; src++)
    for (let dst = 0; dst < 4; dst++)
      if (src !== dst) pool[dst] = mix(pool[dst], hashmix(pool[src]));
  for (let src = 4; src < entropy.length; src++)
    for (let dst = 0; dst < 4; dst++) pool[dst] = mix(pool[dst], hashmix(entropy[src]));
  let h = INIT_B;
  const words = [];
  for (let i = 0; i < 8; i++) {
    let v = (pool[i % 4] ^ h) >>> 0;
    h = Math.imul(h, MULT_B) >>> 0;
    v = Math.imul(v, h) >>> 0;
    words.push((v ^ (v >>> 16)) >>> 0);
  }
  const u64 = [];
  for (let k = 0; k < 4; k++) u64.push(BigInt(words[2 * k]) | (BigInt(words[2 * k + 1]) << 32n));
  return u64;
}

// the float32 ziggurat's tables, built as numpy's were (Marsaglia & Tsang; r and v for 256 layers);
// ki rounded to 23-bit integers, wi and fi rounded to float32
const ZIG_R = 3.6541528853610088, ZIG_V = 0.00492867323399;
const R_F = Math.fround(ZIG_R), INV_R_F = Math.fround(1 / ZIG_R);
const KI = new Uint32Array(256), WI = new Float32Array(256), FI = new Float32Array(256);
(() => {
  const m = 2 ** 23;
  let dn = ZIG_R, tn = dn;
  const q = ZIG_V / Math.exp(-0.5 * dn * dn);
  KI[0] = Math.round((dn / q) * m); KI[1] = 0;
  WI[0] = q / m; WI[255] = dn / m;
  FI[0] = 1; FI[255] = Math.exp(-0.5 * dn * dn);
  for (let i = 254; i >= 1; i--) {
    dn = Math.sqrt(-2 * Math.log(ZIG_V / dn + Math.exp(-0.5 * dn * dn)));
    KI[i + 1] = Math.round((dn / tn) * m);
    tn = dn;
    FI[i] = Math.exp(-0.5 * dn * dn);
    WI[i] = dn / m;
  }
})();


// C's log1pf as numpy calls it for the ziggurat's tail (npy_log1pf is libm's log1pf). glibc up to 2.40
// (Debian 12 has 2.36) computes it in float32 by fdlibm's float log1p algorithm (Sun Microsystems,
// freely distributable), which is not correctly rounded: Math.fround(Math.log1p(x)) differs from it for
// ~7% of inputs. Only x in (-1, 0] occurs here (x = -U, U in [0, 1) on a 2**-24 grid).
const F32 = new Float32Array(1), I32 = new Int32Array(F32.buffer);
const bits = (x) => { F32[0] = x; return I32[0]; };
const fromBits = (i) => { I32[0] = i; return F32[0]; };
const f = Math.fround;
const LN2_HI = f(6.9313812256e-01), LN2_LO = f(9.0580006145e-06);
const LP = [6.6666668653e-01, 4.0000000596e-01, 2.8571429849e-01, 2.2222198546e-01, 1.8183572590e-01,
            1.5313838422e-01, 1.4798198640e-01].map(f);

export function log1pf(x) {
  x = f(x);
  const hx = bits(x), ax = hx & 0x7fffffff;
  if (!(x > -1) || x > 0) return f(Math.log1p(x));  // outside (-1, 0]: never reached by the sampler
  if (ax < 0x31000000) return ax < 0x24800000 ? x : f(x - f(f(x * x) * 0.5));  // |x| < 2**-29
  let k = 1, fx, hu, c = 0;
  if (hx <= (0xbe95f61f | 0)) { k = 0; fx = x; hu = 1; }  // -0.2929 <= x <= 0
  else {
    let u = f(1 + x);
    hu = bits(u);
    k = (hu >> 23) - 127;
    c = k > 0 ? f(1 - f(u - x)) : f(x - f(u - 1));
    c = f(c / u);
    hu &= 0x007fffff;
    if (hu < 0x3504f7) u = fromBits(hu | 0x3f800000);
    else { k += 1; u = fromBits(hu | 0x3f000000); hu = (0x00800000 - hu) >> 2; }
    fx = f(u - 1);
  }
  const hfsq = f(f(0.5 * fx) * fx);
  if (hu === 0) {
    if (fx === 0) return k === 0 ? 0 : f(f(k * LN2_HI) + f(c + f(k * LN2_LO)));
    const R = f(hfsq * f(1 - f(f(0.66666666666666666) * fx)));
    return k === 0 ? f(fx - R) : f(f(k * LN2_HI) - f(f(R - f(f(k * LN2_LO) + c)) - fx));
  }
  const s = f(fx / f(2 + fx)), z = f(s * s);
  let p = LP[6];
  for (let i = 5; i >= 0; i--) p = f(LP[i] + f(z * p));
  const R = f(z * p);
  if (k === 0) return f(fx - f(hfsq - f(s * f(hfsq + R))));
  return f(f(k * LN2_HI) - f(f(hfsq - f(f(s * f(hfsq + R)) + f(f(k * LN2_LO) + c))) - fx));
}

export class NumpyRandom {
  constructor(seed) {
    const [s0, s1, i0, i1] = seedSequenceState(seed);
    const initState = (s0 << 64n) | s1, initSeq = (i0 << 64n) | i1;
    this.inc = ((initSeq << 1n) | 1n) & MASK128;
    this.state = 0n;
    this.step();
    this.state = (this.state + initState) & MASK128;
    this.step();
    this.hasHalf = false;
    this.half = 0;
  }

  step() { this.state = (this.state * PCG_MULT + this.inc) & MASK128; }

  nextU64() {  // step, then XSL-RR of the new state
    this.step();
    const s = this.state;
    const x = ((s >> 64n) ^ s) & MASK64;
    const rot = s >> 122n;
    return ((x >> rot) | (x << ((64n - rot) & 63n))) & MASK64;
  }

  nextU32() {
    if (this.hasHalf) { this.hasHalf = false; return this.half; }
    const v = this.nextU64();
    this.hasHalf = true;
    this.half = Number(v >> 32n);
    return Number(v & 0xffffffffn);
  }

  nextFloat() { return (this.nextU32() >>> 8) * (1 / 16777216); }

  normal() {
    for (;;) {
      const r = this.nextU32();
      const idx = r & 0xff, sign = (r >>> 8) & 1, rabs = (r >>> 9) & 0x7fffff;
      let x = Math.fround(rabs * WI[idx]);
      if (sign) x = -x;
      if (rabs < KI[idx]) return x;
      if (idx === 0) {
        for (;;) {
          const xx = Math.fround(-INV_R_F * log1pf(-this.nextFloat()));
          const yy = -log1pf(-this.nextFloat());
          if (Math.fround(yy + yy) > Math.fround(xx * xx))
            return ((rabs >>> 8) & 1) ? -Math.fround(R_F + xx) : Math.fround(R_F + xx);
        }
      } else {
        const f = Math.fround(Math.fround(Math.fround(FI[idx - 1] - FI[idx]) * this.nextFloat()) + FI[idx]);
        if (f < Math.exp(-0.5 * x * x)) return x;
      }
    }
  }

  // standard_normal(shape, dtype=float32): C order, one draw after another
  standardNormal(count) {
    const out = new Float32Array(count);
    for (let i = 0; i < count; i++) out[i] = this.normal();
    return out;
  }
}
