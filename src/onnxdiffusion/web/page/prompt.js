// Prompt -> token ids as the Python pipeline's PromptTokenizer makes them (runtime/tokenizer.py):
// the tokenizer.json's own tokens (no special tokens), cut to leave room for [bos] and eos, then padded.
// An LLM text encoder's prompt (spec.chat: Z-Image, FLUX.2, Qwen-Image) goes as its PaddedTokenizer takes it:
// inside the chat template export rendered, tokenized whole, truncated, padded to a fixed length or not, with
// its attention mask. The BPE itself is @huggingface/tokenizers over the folder's tokenizer.json.

export class PromptEncoder {
  constructor(Tokenizer, tokenizerJson, configJson, spec) {
    this.tok = new Tokenizer(tokenizerJson, configJson);
    this.maxLength = spec.max_length;
    this.bos = spec.bos;  // null: no bos (T5)
    this.eos = spec.eos;
    this.pad = spec.pad;
    this.chat = spec.chat || null;
    this.dtype = spec.dtype || "int32";
  }

  encodeChat(prompt) {
    const c = this.chat;
    for (const s of c.strip) prompt = prompt.replaceAll(s, "");
    let ids = this.tok.encode(c.head + prompt + c.tail, { add_special_tokens: c.special_tokens }).ids.map(Number);
    let dropped = null;
    if (c.truncate !== null && ids.length > c.truncate) {
      dropped = this.tok.decode(ids.slice(c.truncate)).trim();
      ids = ids.slice(0, c.truncate);
    }
    const length = c.pad_to === null ? ids.length : Math.max(c.pad_to, ids.length);
    const Typed = this.dtype === "int64" ? BigInt64Array : Int32Array;
    const cast = this.dtype === "int64" ? BigInt : Number;
    const out = new Typed(length).fill(cast(c.pad)), mask = new Typed(length).fill(cast(0));
    ids.forEach((id, i) => { out[i] = cast(id); mask[i] = cast(1); });
    return { ids: out, mask, dropped };
  }

  // {ids: Int32Array(maxLength), dropped: the words cut off (null when the prompt fits)}; a chat spec's:
  // {ids, mask: BigInt64Array or Int32Array (spec.dtype) of the prompt's own length or spec.chat.pad_to, dropped}
  encode(prompt) {
    if (this.chat) return this.encodeChat(prompt);
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
