// node check_rng.mjs CASES.json OUT.bin: for each [seed (string), [count, ...]] the page's generator draws
// count float32 normals per call in order (one generator per seed), all written to OUT.bin.
import fs from "node:fs";
import path from "node:path";
import { pathToFileURL } from "node:url";

const [rngJs, casesFile, outFile] = process.argv.slice(2);
const { NumpyRandom } = await import(pathToFileURL(path.resolve(rngJs)).href);
const chunks = [];
for (const [seed, counts] of JSON.parse(fs.readFileSync(casesFile, "utf8"))) {
  const g = new NumpyRandom(BigInt(seed));
  for (const c of counts) chunks.push(Buffer.from(g.standardNormal(c).buffer));
}
fs.writeFileSync(outFile, Buffer.concat(chunks));
