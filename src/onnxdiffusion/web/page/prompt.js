// Prompt -> token ids as the Python pipeline's PromptTokenizer makes them (runtime/tokenizer.py):
// the tokenizer.json's own tokens (no special tokens), cut to leave room for [bos] and eos, then padded.
// The BPE itself is @huggingface/tokenizers over the folder's tokenizer.json.

export class PromptEncoder {
  constructor(Tokenizer, tokenizerJson, configJson, spec) {
    this.tok = new Tokenizer(tokenizerJson, configJson);
    this.maxLength = spec.max_length;
    this.bos = spec.bos;  // null: no bos (T5)
    this.eos = spec.eos;
    this.pad = spec.pad;
  }

  // {ids: Int32Array(maxLength), dropped: the words cut off (null when the prompt fits)}
  encode(prompt) {
    let ids = this.tok.encode(prompt, { add_special_tokens: false }).ids.map(Number);
    const head = this.bos === null ? [] : [this.bos];
    const room = this.maxLength - 1 - head.length;
    let dropped = null;
    if (ids.length > room) {
      // CLIP marks word ends with </w>: show the dropped words as words
      dropped = this.tok.decode(ids.slice(room)).replaceAll("</w>", " ").trim();
      ids = ids.slice(0, room);
    }
    const out = new Int32Array(this.maxLength).fill(this.pad);
    out.set([...head, ...ids, this.eos]);
    return { ids: out, dropped };
  }
}
