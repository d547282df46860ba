// @teovilla/code-runner-react 0.4.2 (CodeRunnerProvider + useCodeRunnerJob on pusher-js),
// mounted with react-dom in jsdom, against a real coderunner stack; the seed SDK
// (@teovilla/code-runner-sdk-node 0.4.0) drives the jobs. Neither package is changed.
import assert from "node:assert/strict";
import http from "node:http";
import { afterEach, test } from "node:test";
import { createChannelAuthorizer } from "@teovilla/code-runner-sdk-node";
import { ENDED, endJobs, eventLog, execute, mountJob, py, rawListener, realtime, sdk, sleep, unmountAll, waitFor, waitState, withTimeout } from "./lib.mjs";

afterEach(async () => {
  unmountAll();
  await endJobs();
});

const client = sdk();

test("interactive stdin: the hook shows the prompt, sendStdin answers it, the transcript is exact", { timeout: 30000 }, async () => {
  const job = await execute(client, py('name = input("What is your name? ")\nprint(f"Hello, {name}!")\n'));
  assert.equal(job.status, "queued");
  assert.equal(job.channel, `private-run-${job.jobId}`);
  assert.match(job.jobId, /^[0-9a-f]{32}$/);

  // A second, plain pusher-js subscriber records the raw events with their seq numbers.
  const raw = await rawListener(job, job.jobToken);
  try {
    await withTimeout(raw.subscribed, 10000, "the raw pusher-js subscription");
    const view = await mountJob(job, { jobId: job.jobId, onSubscribed: () => client.start(job.jobId) });

    await view.waitFor((s) => s.stdout === "What is your name? ", 15000, "the prompt never showed");
    assert.equal(view.state.status, "running");
    assert.equal(view.state.stage, "running");
    assert.equal(view.state.result, null);
    assert.equal(view.text("stdout"), "What is your name? ");

    await client.sendStdin(job.jobId, "Ada\n");
    await view.waitFor((s) => s.status === "done", 15000, "no result after the answer");
    const state = view.state;
    assert.equal(state.stdout, "What is your name? Hello, Ada!\n");
    assert.equal(state.stderr, "");
    assert.equal(state.compileOutput, "");
    assert.equal(state.result.exitCode, 0);
    assert.equal(state.result.signal, null);
    assert.equal(state.result.outcome, "completed");
    assert.equal(state.result.timedOut, false);
    assert.equal(view.text("stdout"), "What is your name? Hello, Ada!\n");
    assert.equal(view.text("status"), "done");

    // seq numbers: a subscriber that was there before start (start is only sent once the
    // hook's subscription succeeded) sees every event live from seq 0, stage{queued}, with
    // no gap, exactly as the durable log (GET /v1/jobs/:id/events) has them.
    await waitFor(() => raw.events.some((e) => e.event === "result"), 5000, () => `raw listener: ${JSON.stringify(raw.events)}`);
    assert.deepEqual(raw.events[0], { event: "stage", data: { phase: "queued", seq: 0 } });
    assert.deepEqual(raw.events.map((e) => e.data.seq), raw.events.map((_, i) => i));
    assert.deepEqual(raw.events.filter((e) => e.event === "stage").map((e) => e.data.phase), ["queued", "running"]);
    assert.deepEqual(raw.events.at(-1), { event: "result", data: { ...state.result } });
    assert.deepEqual(await eventLog(job.jobId), raw.events);
    view.unmount();
  } finally {
    raw.close();
  }
});

test("kill: a running infinite loop ends killed by SIGKILL", { timeout: 30000 }, async () => {
  const job = await execute(client, py('print("spinning", flush=True)\nwhile True:\n    pass\n', { limits: { wallTimeMs: 10000 } }));
  const view = await mountJob(job, { jobId: job.jobId, onSubscribed: () => client.start(job.jobId) });
  await view.waitFor((s) => s.stdout === "spinning\n", 15000, "the loop never started");
  assert.equal(view.state.status, "running");

  const killedAt = Date.now();
  await client.kill(job.jobId);
  await view.waitFor((s) => s.status === "done", 10000, "no result after kill");
  const { result } = view.state;
  assert.equal(result.outcome, "killed");
  assert.equal(result.signal, "SIGKILL");
  assert.equal(result.killedBy, "user");
  assert.equal(result.timedOut, false);
  assert.ok(Date.now() - killedAt < 5000, `kill took ${Date.now() - killedAt} ms`);
  assert.equal(view.state.stdout, "spinning\n");
  const status = await client.getJob(job.jobId);
  assert.equal(status.state, "killed");
  assert.equal(status.result.outcome, "killed");
  view.unmount();
});

test("closeStdin: a program reading all of stdin gets exactly the chunks sent, then EOF", { timeout: 30000 }, async () => {
  const job = await execute(client, py("import sys\nsys.stdout.write(sys.stdin.read())\n"));
  const view = await mountJob(job, { jobId: job.jobId, onSubscribed: () => client.start(job.jobId) });
  await view.waitFor((s) => s.stage === "running", 15000, "the program never started");

  for (const chunk of ["alpha\n", "beta\n", "gamma"]) await client.sendStdin(job.jobId, chunk);
  // stdin stays open: the program is still reading.
  await sleep(300);
  assert.equal(view.state.status, "running");
  assert.equal(view.state.result, null);
  assert.equal((await client.getJob(job.jobId)).state, "running");

  await client.closeStdin(job.jobId);
  await view.waitFor((s) => s.status === "done", 10000, "no result after closeStdin");
  assert.equal(view.state.stdout, "alpha\nbeta\ngamma");
  assert.equal(view.state.stderr, "");
  assert.equal(view.state.result.exitCode, 0);
  assert.equal(view.state.result.outcome, "completed");
  view.unmount();
});

test("compile error: the hook shows gcc's diagnostic in compileOutput", { timeout: 30000 }, async () => {
  const source = '#include <stdio.h>\n\nint main(void) {\n    printf("%d\\n", undeclared_value);\n    return 0;\n}\n';
  const job = await execute(client, { language: "c", files: [{ name: "main.c", content: source }] });
  const view = await mountJob(job, { jobId: job.jobId, onSubscribed: () => client.start(job.jobId) });
  await view.waitFor((s) => s.status === "done", 25000, "no result for the compile error");
  const state = view.state;
  assert.match(state.compileOutput, /error/);
  assert.match(state.compileOutput, /undeclared_value/);
  assert.match(state.compileOutput, /main\.c:4/);
  assert.equal(view.text("compile"), state.compileOutput);
  assert.equal(state.result.outcome, "compile_error");
  assert.notEqual(state.result.compile.exitCode, 0);
  assert.equal(state.result.compile.output, state.compileOutput);
  assert.equal(state.stdout, "");
  assert.equal(state.stage, "compiling");
  view.unmount();
});

test("late subscriber: a hook mounted after its job ended hears how it ended, and again after a reload", { timeout: 30000 }, async () => {
  const job = await execute(client, py('print("early bird")\n'));
  await client.start(job.jobId);
  const ended = await waitState(client, job.jobId, ENDED);
  assert.equal(ended.state, "done");
  assert.equal(ended.result.exitCode, 0);

  // Nobody followed it live: the first subscription gets its log replayed (soketi's webhook),
  // with no onResolveStatus to reconcile by.
  const first = await mountJob(job, { jobId: job.jobId });
  await first.waitFor((s) => s.status === "done", 10000, "the late replay never came");
  assert.equal(first.state.stdout, "early bird\n");
  assert.equal(first.state.result.exitCode, 0);
  first.unmount();
  await sleep(300); // (soketi has seen the last subscriber go)

  // The page reloaded: a new first subscriber of the ended job's channel hears its result (for a
  // job that expired or was lost, the only way the hook learns it ended: its status
  // reconciliation takes those states for "queued").
  const reloaded = await mountJob(job, { jobId: job.jobId });
  await reloaded.waitFor((s) => s.status === "done", 10000, "the reloaded hook never heard the result");
  assert.deepEqual(reloaded.state.result, ended.result);
  reloaded.unmount();

  // onResolveStatus still reconciles as before.
  const view = await mountJob(job, {
    jobId: job.jobId,
    onResolveStatus: () => client.getStatus(job.jobId).then((s) => s.state),
  });
  await view.waitFor((s) => s.status === "done", 10000, "status never reconciled to done");
  assert.equal(view.text("status"), "done");
  view.unmount();
});

test("a backend that signs subscriptions itself (createChannelAuthorizer): the hook hears every run whole", { timeout: 60000 }, async () => {
  // The SDK README's "channel auth" route: the app's own backend signs private-run-*
  // subscriptions with the soketi app key and secret; the API is never asked.
  const secret = process.env.CODERUNNER_PUSHER_SECRET;
  assert.ok(secret, "CODERUNNER_PUSHER_SECRET must be the stack's soketi app secret");
  const info = await realtime();
  const authorize = createChannelAuthorizer({ appKey: info.key, appSecret: secret });
  const backend = http.createServer((req, res) => {
    let body = "";
    req.on("data", (chunk) => (body += chunk));
    req.on("end", () => {
      const form = new URLSearchParams(body);
      res.setHeader("content-type", "application/json");
      res.end(JSON.stringify(authorize(form.get("socket_id"), form.get("channel_name"))));
    });
  });
  await new Promise((resolve) => backend.listen(0, "127.0.0.1", resolve));
  const auth = { authEndpoint: `http://127.0.0.1:${backend.address().port}/channel-auth` };
  try {
    // Quick ones first (they end within milliseconds of the start), then a longer one.
    const programs = [
      ['print("one")\n', "one\n"],
      ['print("two")\n', "two\n"],
      ['import time\nfor i in range(5):\n    print(i, flush=True)\n    time.sleep(0.05)\n', "0\n1\n2\n3\n4\n"],
    ];
    for (const [source, expected] of programs) {
      const job = await execute(client, py(source));
      const view = await mountJob(job, { jobId: job.jobId, onSubscribed: () => client.start(job.jobId) }, auth);
      await view.waitFor((s) => s.status === "done", 15000, `no live result for ${JSON.stringify(source)}`);
      assert.equal(view.state.stdout, expected);
      assert.equal(view.state.result.outcome, "completed");
      assert.equal(view.state.stage, "running");
      view.unmount();
    }
  } finally {
    backend.close();
  }
});
