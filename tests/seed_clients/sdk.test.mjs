// @teovilla/code-runner-sdk-node 0.4.0 on its own (no WebSocket) against a real coderunner
// stack: the grader path and the typed errors, used exactly as its README documents.
import assert from "node:assert/strict";
import { afterEach, test } from "node:test";
import {
  CodeRunnerError,
  NotFoundError,
  RateLimitError,
  UnauthorizedError,
  ValidationError,
} from "@teovilla/code-runner-sdk-node";
import { API_URL, API_TOKEN, ENDED, endJobs, execute, py, sdk, sleep, waitFor, waitState } from "./lib.mjs";

afterEach(endJobs);

const client = sdk();
const UNKNOWN_ID = "0123456789abcdef0123456789abcdef";

/** Await `promise`, expecting it to reject with an instance of `type`; return the error. */
async function rejectsWith(promise, type, what) {
  try {
    const value = await promise;
    assert.fail(`${what}: expected ${type.name}, got success ${JSON.stringify(value)}`);
  } catch (err) {
    if (err instanceof assert.AssertionError) throw err;
    assert.ok(err instanceof type, `${what}: expected ${type.name}, got ${err?.name} ${err?.status} ${err?.message} ${JSON.stringify(err?.body)}`);
    assert.ok(err instanceof CodeRunnerError);
    return err;
  }
}

/** Poll getOutput until it stops answering NotFoundError (any other error fails). */
async function pollOutput(jobId, timeoutMs = 20000) {
  let output;
  await waitFor(
    async () => {
      try {
        output = await client.getOutput(jobId);
        return true;
      } catch (err) {
        if (err instanceof NotFoundError) return false;
        throw err;
      }
    },
    timeoutMs,
    () => `no output for ${jobId}`,
  );
  return output;
}

test("grader path: execute(collectOutput) + start, poll getOutput, getJob says done", { timeout: 30000 }, async () => {
  const job = await execute(client, 
    py('import sys\nprint("sum", sum(map(int, sys.stdin.read().split())))\n', { stdin: "1 2 3\n39\n", collectOutput: true }),
  );
  assert.equal(job.status, "queued");
  await rejectsWith(client.getOutput(job.jobId), NotFoundError, "output before start");
  await client.start(job.jobId);
  await client.start(job.jobId); // idempotent
  const output = await pollOutput(job.jobId);
  assert.equal(output.stdout, "sum 45\n");
  assert.equal(output.stderr, "");
  assert.equal(output.exitCode, 0);
  assert.equal(output.outcome, "completed");
  assert.equal(output.truncated, false);
  const status = await client.getJob(job.jobId);
  assert.equal(status.jobId, job.jobId);
  assert.equal(status.state, "done");
  assert.equal(status.result.exitCode, 0);
  assert.equal(status.result.outcome, "completed");

  // The same output by long-polling ?waitMs (plain fetch: the SDK has no option for it).
  const response = await fetch(`${API_URL}/v1/jobs/${job.jobId}/output?waitMs=5000`, {
    headers: { Authorization: `Bearer ${job.jobToken}` },
  });
  assert.equal(response.status, 200);
  assert.equal((await response.json()).stdout, "sum 45\n");
});

test("grader path: ?waitMs long-polls until the output exists", { timeout: 30000 }, async () => {
  const job = await execute(client, py('import time\ntime.sleep(0.5)\nprint("slow")\n', { collectOutput: true }));
  await client.start(job.jobId);
  const started = Date.now();
  const response = await fetch(`${API_URL}/v1/jobs/${job.jobId}/output?waitMs=15000`, {
    headers: { Authorization: `Bearer ${API_TOKEN}` },
  });
  assert.equal(response.status, 200, await response.clone().text());
  const output = await response.json();
  assert.equal(output.stdout, "slow\n");
  assert.ok(Date.now() - started >= 400, "answered before the program could have finished");
  assert.equal((await client.getJob(job.jobId)).state, "done");
});

test("listLanguages: python and c are offered", { timeout: 10000 }, async () => {
  const languages = await client.listLanguages();
  assert.ok(Array.isArray(languages), JSON.stringify(languages));
  const names = languages.map((l) => l.language);
  assert.ok(names.includes("python") && names.includes("c"), JSON.stringify(names));
});

test("ValidationError: a bad body is a 400 whose details name the field", { timeout: 10000 }, async () => {
  const unknown = await rejectsWith(
    client.execute({ language: "cobol", files: [{ name: "main.cob", content: "x" }] }),
    ValidationError,
    "unknown language",
  );
  assert.equal(unknown.status, 400);
  assert.deepEqual(unknown.body.details.map((d) => d.field), ["language"]);
  assert.match(unknown.message, /language/);

  const missing = await rejectsWith(client.execute({ language: "python" }), ValidationError, "missing files");
  assert.equal(missing.status, 400);
  assert.deepEqual(missing.body.details.map((d) => d.field), ["files"]);

  const limits = await rejectsWith(
    client.execute(py("print(1)", { limits: { memoryMb: 999999 } })),
    ValidationError,
    "memory over the maximum",
  );
  assert.deepEqual(limits.body.details.map((d) => d.field), ["limits.memoryMb"]);

  // The seed named the place `path`, its validator's path joined by dots: kept beside `field`.
  const file = await rejectsWith(
    client.execute({ language: "python", files: [{ name: "main.py", content: "x" }, { name: "../up.py", content: "x" }] }),
    ValidationError,
    "a file name climbing out",
  );
  assert.deepEqual(file.body.details.map((d) => [d.field, d.path]), [["files[1].name", "files.1.name"]]);
  assert.deepEqual(limits.body.details.map((d) => d.path), ["limits.memoryMb"]);
});

test("NotFoundError: an unknown job id, and another job's id under a job token", { timeout: 30000 }, async () => {
  for (const [name, call] of [
    ["getJob", () => client.getJob(UNKNOWN_ID)],
    ["getOutput", () => client.getOutput(UNKNOWN_ID)],
    ["start", () => client.start(UNKNOWN_ID)],
  ]) {
    const err = await rejectsWith(call(), NotFoundError, `${name} of an unknown id`);
    assert.equal(err.status, 404);
  }

  const a = await execute(client, py('print("a")\n'));
  const b = await execute(client, py('print("b")\n'));
  const asA = sdk(a.jobToken);
  for (const [name, call] of [
    ["getJob", () => asA.getJob(b.jobId)],
    ["getOutput", () => asA.getOutput(b.jobId)],
    ["start", () => asA.start(b.jobId)],
    ["getJob unknown", () => asA.getJob(UNKNOWN_ID)],
  ]) {
    await rejectsWith(call(), NotFoundError, `${name} of job B with job A's token`);
  }
  // The job token does work for its own job; both jobs run to completion (no parked leftovers).
  assert.equal((await asA.getJob(a.jobId)).jobId, a.jobId);
  await asA.start(a.jobId);
  await sdk(b.jobToken).start(b.jobId);
  assert.equal((await waitState(asA, a.jobId, ENDED)).state, "done");
  assert.equal((await waitState(client, b.jobId, ENDED)).state, "done");
});

test("UnauthorizedError: a wrong bearer token is a 401", { timeout: 10000 }, async () => {
  const wrong = sdk("not-the-token");
  for (const [name, call] of [
    ["execute", () => wrong.execute(py("print(1)"))],
    ["listLanguages", () => wrong.listLanguages()],
    ["getJob", () => wrong.getJob(UNKNOWN_ID)],
  ]) {
    const err = await rejectsWith(call(), UnauthorizedError, name);
    assert.equal(err.status, 401);
  }
});

test("job tokens on the interactive endpoints: own job works, another job is a NotFoundError", { timeout: 30000 }, async () => {
  const echo = "import sys\nsys.stdout.write(sys.stdin.read())\n";
  const a = await execute(client, py(echo, { collectOutput: true }));
  const b = await execute(client, py(echo, { collectOutput: true }));
  const asA = sdk(a.jobToken);
  for (const [name, call] of [
    ["getStatus", () => asA.getStatus(b.jobId)],
    ["sendStdin", () => asA.sendStdin(b.jobId, "x\n")],
    ["closeStdin", () => asA.closeStdin(b.jobId)],
    ["kill", () => asA.kill(b.jobId)],
    ["getStatus unknown", () => client.getStatus(UNKNOWN_ID)],
    ["sendStdin unknown", () => client.sendStdin(UNKNOWN_ID, "x\n")],
    ["kill unknown", () => client.kill(UNKNOWN_ID)],
  ]) {
    await rejectsWith(call(), NotFoundError, name);
  }

  // getStatus is the same body as getJob.
  assert.deepEqual(await asA.getStatus(a.jobId), await asA.getJob(a.jobId));

  // A's token drives A: stdin before start is kept, then start, more stdin, close.
  await asA.sendStdin(a.jobId, "one\n");
  await asA.start(a.jobId);
  await asA.sendStdin(a.jobId, "two\n");
  await asA.closeStdin(a.jobId);
  const outA = await pollOutput(a.jobId);
  assert.equal(outA.stdout, "one\ntwo\n");
  assert.equal(outA.exitCode, 0);
  const endedA = await asA.getStatus(a.jobId);
  assert.equal(endedA.state, "done");
  assert.deepEqual(endedA, await asA.getJob(a.jobId));

  // Once the job has ended, stdin is refused with 409 (a plain CodeRunnerError).
  const late = await rejectsWith(asA.sendStdin(a.jobId, "three\n"), CodeRunnerError, "stdin after the end");
  assert.equal(late.status, 409);

  // B was untouched by A's token: it still runs normally with its own.
  const asB = sdk(b.jobToken);
  await asB.start(b.jobId);
  await asB.sendStdin(b.jobId, "bee\n");
  await asB.closeStdin(b.jobId);
  assert.equal((await pollOutput(b.jobId)).stdout, "bee\n");
});

test("RateLimitError: more than 30 stdin frames a second on one job is a 429 with retryAfterMs", { timeout: 30000 }, async () => {
  const job = await execute(client, py("import sys\nsys.stdout.write(sys.stdin.read())\n", { collectOutput: true }));
  // Not started: the frames are only accepted and kept. Send until the first refusal.
  const accepted = [];
  let refused;
  const began = Date.now();
  for (let i = 0; i < 60 && !refused; i++) {
    const chunk = `f${String(i).padStart(2, "0")}\n`;
    try {
      await client.sendStdin(job.jobId, chunk);
      accepted.push(chunk);
    } catch (err) {
      refused = err;
    }
  }
  const elapsed = Date.now() - began;
  assert.ok(refused, `60 frames in ${elapsed} ms were all accepted`);
  assert.ok(refused instanceof RateLimitError, `${refused?.name} ${refused?.status} ${JSON.stringify(refused?.body)}`);
  assert.equal(refused.status, 429);
  assert.ok(Number.isInteger(refused.retryAfterMs) && refused.retryAfterMs > 0 && refused.retryAfterMs <= 1000, `retryAfterMs ${refused.retryAfterMs}`);
  assert.equal(refused.capBytes, undefined);
  assert.ok(accepted.length >= 30, `only ${accepted.length} frames accepted before the refusal`);
  if (elapsed < 900) assert.equal(accepted.length, 30, `a burst of ${elapsed} ms`);

  // After waiting as told, the job goes on: it receives exactly the accepted frames.
  await sleep(refused.retryAfterMs + 50);
  await client.start(job.jobId);
  await client.closeStdin(job.jobId);
  const output = await pollOutput(job.jobId);
  assert.equal(output.stdout, accepted.join(""));
  assert.equal(output.exitCode, 0);
});

test("RateLimitError: more than 64 KiB of stdin waiting for the program is a 429 with capBytes", { timeout: 30000 }, async () => {
  const job = await execute(client, 
    py('import sys\ndata = sys.stdin.read()\nprint(len(data), data.count("\\n"))\n', { collectOutput: true }),
  );
  const chunk = "a".repeat(8191) + "\n"; // 8 KiB
  for (let i = 0; i < 8; i++) await client.sendStdin(job.jobId, chunk); // exactly 64 KiB: accepted
  const err = await rejectsWith(client.sendStdin(job.jobId, "b".repeat(6 * 1024)), RateLimitError, "70 KiB before start");
  assert.equal(err.status, 429);
  assert.equal(err.capBytes, 65536);

  // One frame bigger than may ever wait: the seed's 429 with capBytes too, which its users
  // split their input by.
  const whole = await rejectsWith(client.sendStdin(job.jobId, "c".repeat(65537)), RateLimitError, "one 64 KiB + 1 frame");
  assert.equal(whole.capBytes, 65536);

  await client.start(job.jobId);
  await client.closeStdin(job.jobId);
  const output = await pollOutput(job.jobId);
  assert.equal(output.stdout, "65536 8\n");
  assert.equal(output.exitCode, 0);
});

test("executeFiles: a binary over 256 KiB goes through the blob store, byte for byte", { timeout: 30000 }, async () => {
  const { createHash, randomBytes } = await import("node:crypto");
  const big = randomBytes(300 * 1024 + 7); // over DEFAULT_INLINE_THRESHOLD_BYTES: uploaded, sent as a ref
  const small = randomBytes(1000); // under it: inline base64
  const sha = (buf) => createHash("sha256").update(buf).digest("hex");
  const main = [
    "import hashlib",
    'for name in ("data/big.bin", "small.bin"):',
    '    raw = open(name, "rb").read()',
    "    print(name, len(raw), hashlib.sha256(raw).hexdigest())",
    "",
  ].join("\n");
  const files = [
    { name: "main.py", content: main },
    { name: "data/big.bin", data: big },
    { name: "small.bin", data: small },
  ];
  const expected = `data/big.bin ${big.length} ${sha(big)}\nsmall.bin ${small.length} ${sha(small)}\n`;
  const ref = `sha256:${sha(big)}`;
  const first = await client.blobs.check([ref]);
  assert.deepEqual(first.present, []);
  assert.equal(first.missing.length, 1);
  assert.equal(first.missing[0].hash, ref);
  assert.ok(first.missing[0].uploadUrl.startsWith(`${API_URL}/v1/blobs/uploads/${sha(big)}?`), first.missing[0].uploadUrl);

  const job = await client.executeFiles({ language: "python", files, collectOutput: true });
  await client.start(job.jobId);
  const output = await pollOutput(job.jobId);
  assert.equal(output.stdout, expected, output.stderr);
  assert.equal(output.exitCode, 0);

  // Uploaded once, it is present now: a second executeFiles skips the PUT, and a raw
  // `{name, ref}` file works with execute itself.
  assert.deepEqual(await client.blobs.check([ref]), { missing: [], present: [ref] });
  assert.deepEqual(await client.blobs.upload(big), { ref });
  const again = await client.execute({
    language: "python",
    files: [{ name: "main.py", content: main }, { name: "data/big.bin", ref }, { name: "small.bin", content: small.toString("base64"), encoding: "base64" }],
    collectOutput: true,
  });
  await client.start(again.jobId);
  assert.equal((await pollOutput(again.jobId)).stdout, expected);

  // A ref to bytes never uploaded is a ValidationError naming the file.
  const unknown = `sha256:${"0".repeat(64)}`;
  const err = await rejectsWith(
    client.execute({ language: "python", files: [{ name: "main.py", content: main }, { name: "x.bin", ref: unknown }] }),
    ValidationError,
    "a ref to nothing",
  );
  assert.equal(err.body.details[0].field, "files[1].ref");
});
