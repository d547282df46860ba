// The interactive figures, measured with pusher-js as a browser IDE would see them:
//   stdin round trip  POST /stdin sent … the echoed line arriving at the subscriber
//   kill latency      POST /kill sent … the `result` event arriving at the subscriber
// One HTTP client (Node's fetch keeps its connections alive) and one WebSocket for all.
//
//   node bench/interactive.mjs <apiUrl> <apiToken> <lines> <kills>   (bench/interactive.py runs it)
import { apiCaller, connectRealtime } from "../clients/js/stack-client.mjs";

const [apiUrl, apiToken, linesArg, killsArg] = process.argv.slice(2);
const LINES = Number(linesArg || 200);
const KILLS = Number(killsArg || 30);
// The seed's cap is 30 frames/s per job: pace the lines just under it.
const FRAME_GAP_MS = 35;

const call = apiCaller(apiUrl);
const { pusher, tokens } = await connectRealtime(apiUrl);

const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

// Submit, subscribe, start; `onEvent(name, data)` sees every event. Resolves with the job.
function follow(code, onEvent, limits) {
  return new Promise(async (resolve, reject) => {
    const job = await call("POST", "/v1/execute", apiToken, {
      language: "python",
      files: [{ name: "main.py", content: code }],
      ...(limits ? { limits } : {}),
    });
    tokens.set(job.channel, job.jobToken);
    const channel = pusher.subscribe(job.channel);
    channel.bind("pusher:subscription_succeeded", async () => {
      await call("POST", `/v1/jobs/${job.jobId}/start`, job.jobToken).catch(reject);
      resolve(job);
    });
    channel.bind_global((event, data) => {
      if (!event.startsWith("pusher:")) onEvent(event, data);
    });
  });
}

async function stdinRoundTrips() {
  let waiting = null; // {text, resolve}
  let seen = "";
  let ended;
  const result = new Promise((r) => (ended = r));
  const job = await follow(
    "import sys\nfor line in sys.stdin:\n    sys.stdout.write('echo:' + line)\n    sys.stdout.flush()\n",
    (event, data) => {
      if (event === "stdout") {
        seen += data.chunk;
        if (waiting && seen.includes(waiting.text)) {
          waiting.resolve(performance.now());
          waiting = null;
        }
      }
      if (event === "result") ended(data);
    },
    { wallTimeMs: 120000, idleMs: 60000 },
  );
  // Wait for the program to be running: the first round trip must not include start-up.
  await call("POST", `/v1/jobs/${job.jobId}/stdin`, job.jobToken, { chunk: "warm-up\n" });
  await new Promise((r) => (waiting = { text: "echo:warm-up\n", resolve: r }));
  const samples = [];
  for (let i = 0; i < LINES; i++) {
    const text = `echo:line ${i}\n`;
    const arrived = new Promise((r) => (waiting = { text, resolve: r }));
    const t0 = performance.now();
    await call("POST", `/v1/jobs/${job.jobId}/stdin`, job.jobToken, { chunk: `line ${i}\n` });
    samples.push((await arrived) - t0);
    await sleep(FRAME_GAP_MS);
  }
  await call("POST", `/v1/jobs/${job.jobId}/stdin/close`, job.jobToken);
  const last = await result;
  if (last.outcome !== "completed") throw new Error("echo job ended " + JSON.stringify(last));
  pusher.unsubscribe(job.channel);
  return samples;
}

async function killLatencies() {
  const samples = [];
  for (let i = 0; i < KILLS; i++) {
    let ready, ended;
    const isReady = new Promise((r) => (ready = r));
    const result = new Promise((r) => (ended = r));
    const job = await follow("print('ready', flush=True)\nwhile True: pass\n", (event, data) => {
      if (event === "stdout") ready();
      if (event === "result") ended([performance.now(), data]);
    });
    await isReady;
    const t0 = performance.now();
    await call("POST", `/v1/jobs/${job.jobId}/kill`, job.jobToken);
    const [t1, data] = await result;
    if (data.outcome !== "killed") throw new Error("kill ended " + JSON.stringify(data));
    samples.push(t1 - t0);
    pusher.unsubscribe(job.channel);
  }
  return samples;
}

const stdin = await stdinRoundTrips();
const kill = await killLatencies();
console.log(JSON.stringify({ stdin, kill }));
pusher.disconnect();
process.exit(0);
