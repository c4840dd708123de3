// node check_tokens.mjs PAGE_FOLDER PROMPTS.json OUT.json: every text input's ids (the dropped words, an LLM
// encoder's attention mask) for
// each prompt, through the page's own prompt.js and tokenizer package.
import fs from "node:fs";
import path from "node:path";
import { pathToFileURL } from "node:url";

const [page, promptsFile, outFile] = process.argv.slice(2);
const url = (p) => pathToFileURL(path.resolve(page, p)).href;
const { Tokenizer } = await import(url("lib/tokenizers.min.mjs"));
const { PromptEncoder } = await import(url("prompt.js"));
const settings = JSON.parse(fs.readFileSync(path.join(page, "settings.json"), "utf8"));
const prompts = JSON.parse(fs.readFileSync(promptsFile, "utf8"));
const out = {};
for (const t of settings.text_inputs) {
  const read = (p) => JSON.parse(fs.readFileSync(path.join(page, p), "utf8"));
  const enc = new PromptEncoder(Tokenizer, read(t.tokenizer), read(t.config), t);
  out[t.encoder] = prompts.map((p) => {
    const r = enc.encode(p);
    const list = (a) => Array.from(a, Number);  // an LLM encoder's int64 ids come as BigInts
    return { ids: list(r.ids), dropped: r.dropped, ...(r.mask ? { mask: list(r.mask) } : {}) };
  });
}
fs.writeFileSync(outFile, JSON.stringify(out));
