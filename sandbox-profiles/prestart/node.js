// coderunner: a Node.js runtime started in a warm jail before its job exists.
//
// The worker starts this as the interpreter part of the language's `run` command plus this
// file (e.g. `node --max-old-space-size=76 /.coderunner/prestart/node.js`), so V8 and
// Node's bootstrap are done while the jail waits. The jail is the job's own and serves one
// job only. On start the worker sends the frame the gate would have had (argv, environment,
// rlimits; see worker/isolation/gate.c — the worker has already applied the rlimits from
// outside), and this runs the entry file as the main module, the way `node main.js
// args...` would: process.argv, require.main, ES modules for .mjs, and Node's own report
// and exit status for an uncaught error.
//
// Before start, the only thing written is one ready marker on stderr, which the worker
// reads (and so removes) before the jail is offered to a job; the frame is read from stdin
// with exact-size synchronous reads, so not one byte of the program's own input is consumed.
'use strict';
(function serve() {
  const fs = require('fs');
  const path = require('path');

  function readExact(n) {
    const buf = Buffer.alloc(n);
    let got = 0;
    while (got < n) {
      let r;
      try {
        r = fs.readSync(0, buf, got, n - got, null);
      } catch (err) {
        if (err.code === 'EAGAIN' || err.code === 'EINTR') continue;
        throw err;
      }
      if (r === 0) process.exit(0); // the worker closed the pipe: the job never started
      got += r;
    }
    return buf;
  }
  const u32 = () => readExact(4).readUInt32LE(0);
  const strings = () => {
    const out = [];
    for (let i = u32(); i > 0; i--) out.push(readExact(u32()).toString('utf8'));
    return out;
  };

  // A program's first console.log loads the net and stream machinery behind process.stdout
  // and the console's formatting, about 5 ms here, after start. Do that now on a console of
  // its own that writes nowhere: the job's stdout and stderr are not touched (their streams
  // are still made on first use, as in a fresh process), and nothing is left behind but
  // modules the first log would have loaded anyway.
  require('net');
  const sink = new (require('stream').Writable)({ write(_chunk, _encoding, done) { done(); } });
  new console.Console({ stdout: sink, stderr: sink }).log('%s %d', 'warm', 1, { a: [1, 'x'], b: new Map() });

  fs.writeSync(2, '\0coderunner-prestart-ready\n'); // the worker waits for this before offering the jail
  if (readExact(4).toString('latin1') !== 'CRG1') process.exit(0);
  const argv = strings();
  strings(); // environment: the job's is the one this process started with (Prime.adopts)
  readExact(24); // rlimits: already set on this process by the worker

  // argv is the job's whole `run` command: the interpreter part (the same as this process's
  // own) then the entry file and its arguments.
  const prefix = 1 + process.execArgv.length;
  const entry = path.resolve(argv[prefix]);
  process.argv = [process.argv[0], entry, ...argv.slice(prefix + 1)];
  delete require.cache[__filename];
  // The entry runs from the tick queue, after this file's module code has returned: no frame
  // of this shim is on the stack below the program's, so every stack trace (the printed
  // report of an uncaught error or rejection included, and the call sites a program's own
  // Error.prepareStackTrace gets) holds the program's frames and Node's loader's, as under
  // `node main.js`; only the bottom frame is Node's tick processor instead of its
  // main-module runner. A tick, not a promise job, keeps the plain order of what the
  // program's top level queues: its nextTick callbacks run before its promise reactions.
  const Module = require('module');
  process.nextTick(Module.runMain.bind(Module));
})();
