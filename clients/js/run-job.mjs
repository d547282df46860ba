// Run one program through coderunner and follow it with pusher-js, the way a browser IDE
// does: submit, subscribe to the private channel (authorised with the job token), call
// start once, after the subscription succeeded (or without it, should it neither succeed
// nor fail within 4 s, or fail), print every event as a JSON line in `seq` order (each
// once: what live delivery missed, or a silence that outlasted the run, is read from the
// job's event log), and exit after the single `result` event.
//
//   node run-job.mjs [--wall-ms N] [--limits JSON] <apiUrl> <apiToken> <language> <file> [stdin]
//
// stdout carries only the events (one JSON object per line); the job id and any trouble
// go to stderr. It waits as long as the job may legitimately take: the queue wait and the
// warm-up before start, a compile step, then the job's own wall time limit.
import { readFileSync } from "node:fs";
import { basename } from "node:path";
import Pusher from "pusher-js";

const USAGE =
  "usage: node run-job.mjs [--wall-ms N] [--limits JSON] <apiUrl> <apiToken> <language> <file> [stdin]\n" +
  "  --wall-ms N     limits.wallTimeMs of the job (server default 30000)\n" +
  "  --limits JSON   any request limits, e.g. '{\"cpuMs\":2000,\"memoryMb\":256}'";

// Only these options are recognised; every other argument is positional, so an API token
// or stdin that starts with "-" is taken as it is.
const options = { "--wall-ms": undefined, "--limits": undefined };
const positionals = [];
const argv = process.argv.slice(2);
for (let i = 0; i < argv.length; i++) {
  const arg = argv[i];
  const name = arg.split("=", 1)[0];
  if (arg === "--help" || arg === "-h") {
    console.log(USAGE);
    process.exit(0);
  } else if (name in options) {
    const value = arg.includes("=") ? arg.slice(name.length + 1) : argv[++i];
    if (value === undefined) {
      console.error(`${name} needs a value\n${USAGE}`);
      process.exit(2);
    }
    options[name] = value;
  } else {
    positionals.push(arg);
  }
}
const [apiUrl, apiToken, language, file, stdin] = positionals;
if (!file || positionals.length > 5) {
  console.error(USAGE);
  process.exit(2);
}

let limits = {};
try {
  if (options["--limits"] !== undefined) limits = JSON.parse(options["--limits"]);
  if (typeof limits !== "object" || limits === null || Array.isArray(limits)) throw new Error("not an object");
} catch (error) {
  console.error(`--limits must be a JSON object (${error.message})`);
  process.exit(2);
}
if (options["--wall-ms"] !== undefined) {
  const wall = Number(options["--wall-ms"]);
  if (!Number.isInteger(wall) || wall <= 0) {
    console.error("--wall-ms must be a positive whole number of milliseconds");
    process.exit(2);
  }
  limits.wallTimeMs = wall;
}

// How long to wait for the result: the job's wall time limit (the server's default when
// the request does not set one) plus the longest the server lets a job spend before its
// run starts: a queue wait and the warm-up (WORKER_WARMUP_MS, default 30 s) and a compile
// step (at most 30 s wall), with some slack for delivery.
const DEFAULT_WALL_MS = 30000;
const WARMUP_MS = 30000;
const COMPILE_MS = 30000;
const SLACK_MS = 15000;
const waitMs = (limits.wallTimeMs ?? DEFAULT_WALL_MS) + WARMUP_MS + COMPILE_MS + SLACK_MS;

async function call(method, path, token, body) {
  const response = await fetch(apiUrl + path, {
    method,
    headers: { authorization: `Bearer ${token}`, "content-type": "application/json" },
    body: body === undefined ? undefined : JSON.stringify(body),
  });
  const data = await response.json();
  if (!response.ok) throw new Error(`${method} ${path}: ${response.status} ${JSON.stringify(data)}`);
  return data;
}

let job;
try {
  const realtime = await (await fetch(apiUrl + "/v1/realtime")).json();
  job = await call("POST", "/v1/execute", apiToken, {
    language,
    files: [{ name: basename(file), content: readFileSync(file, "utf8") }],
    ...(stdin === undefined ? {} : { stdin }),
    ...(Object.keys(limits).length === 0 ? {} : { limits }),
  });
  console.error(`job ${job.jobId} (waiting up to ${Math.round(waitMs / 1000)} s for its result)`);
  follow(realtime);
} catch (error) {
  console.error(error.message);
  process.exit(1);
}

function follow(realtime) {
  const pusher = new Pusher(realtime.key, {
    cluster: realtime.cluster,
    wsHost: realtime.wsHost,
    wsPort: realtime.wsPort,
    forceTLS: realtime.forceTLS,
    enabledTransports: ["ws"],
    channelAuthorization: {
      endpoint: apiUrl + "/v1/channel-auth",
      transport: "ajax",
      headers: { Authorization: `Bearer ${job.jobToken}` },
    },
  });

  const timer = setTimeout(async () => {
    let state = "unknown";
    try {
      state = (await call("GET", `/v1/jobs/${job.jobId}`, job.jobToken)).state;
    } catch {}
    console.error(`job ${job.jobId}: no result after ${Math.round(waitMs / 1000)} s (state: ${state})`);
    process.exit(1);
  }, waitMs);

  // Events are printed in `seq` order, each once. Live delivery may skip some (soketi sheds a
  // subscriber that reads too slowly, a reconnect misses what went by meanwhile): a hole
  // that does not fill within GAP_MS, or a reconnect, reads the rest from the job's durable
  // event log (GET /v1/jobs/:id/events, Server-Sent Events) from the first seq missing.
  const GAP_MS = 1000;
  // Live delivery is best effort, so a run's last events can be missed with no gap to see
  // (the worker drops an event soketi's HTTP API timed out on): a job silent this long has
  // its status asked, and once it has ended the log brings the rest. A subscription that
  // neither succeeds nor fails this long after the submit (soketi down) starts the job all
  // the same, and the log brings everything.
  const SILENCE_MS = 5000;
  const SUBSCRIBE_WAIT_MS = 4000;
  let next = 0;
  let started = false;
  let ended = false;
  let catchingUp = null;
  let gapTimer = null;
  let lastEventAt = Date.now();
  const early = new Map();

  function take(event, data) {
    if (ended || typeof data?.seq !== "number" || data.seq < next || early.has(data.seq)) return;
    lastEventAt = Date.now();
    early.set(data.seq, { event, data });
    while (early.has(next)) {
      const item = early.get(next);
      early.delete(next);
      next++;
      console.log(JSON.stringify(item));
      if (item.event === "result") return finish();
    }
    // A hole gets GAP_MS from when it opened (not from each event after it) to fill.
    if (!early.size) {
      clearTimeout(gapTimer);
      gapTimer = null;
    } else if (!gapTimer) {
      gapTimer = setTimeout(catchUp, GAP_MS);
    }
  }

  function finish() {
    ended = true;
    clearTimeout(timer);
    clearTimeout(gapTimer);
    pusher.disconnect();
    process.exit(0);
  }

  function catchUp() {
    gapTimer = null;
    if (catchingUp || ended) return;
    let failed = false;
    catchingUp = readLog()
      .catch((error) => {
        failed = true;
        console.error(`reading the event log: ${error.message}; trying again`);
      })
      .finally(() => {
        catchingUp = null;
        // A read that failed (a 503, the network) is tried again until the result is in:
        // after a reconnect nothing else may ever bring it.
        if (!ended && (failed || early.size) && !gapTimer) gapTimer = setTimeout(catchUp, GAP_MS);
      });
  }

  async function readLog() {
    const after = next > 0 ? `?after=${next - 1}` : "";
    const response = await fetch(`${apiUrl}/v1/jobs/${job.jobId}/events${after}`, {
      headers: { authorization: `Bearer ${job.jobToken}`, accept: "text/event-stream" },
    });
    if (response.status === 204) return; // (nothing past `next`: the live view has it all)
    if (!response.ok) throw new Error(`HTTP ${response.status}`);
    const decoder = new TextDecoder();
    let text = "";
    for await (const piece of response.body) {
      text += decoder.decode(piece, { stream: true });
      let end;
      while ((end = text.indexOf("\n\n")) >= 0) {
        const block = text.slice(0, end);
        text = text.slice(end + 2);
        let event = "message";
        const data = [];
        for (const line of block.split("\n")) {
          if (line.startsWith("event:")) event = line.slice(6).trim();
          else if (line.startsWith("data:")) data.push(line.slice(5).replace(/^ /, ""));
        }
        if (data.length) take(event, JSON.parse(data.join("\n")));
        if (ended) return;
      }
    }
  }

  async function checkSilence() {
    if (ended || catchingUp || Date.now() - lastEventAt < SILENCE_MS) return;
    lastEventAt = Date.now();
    try {
      const status = await call("GET", `/v1/jobs/${job.jobId}`, job.jobToken);
      if (status.result || ["done", "killed", "error", "expired", "lost"].includes(status.state)) catchUp();
    } catch {} // (asked again after the next silence)
  }

  async function start(followLog) {
    if (started) return;
    started = true;
    clearTimeout(subscribeTimer);
    lastEventAt = Date.now();
    setInterval(checkSilence, SILENCE_MS / 2);
    try {
      await call("POST", `/v1/jobs/${job.jobId}/start`, job.jobToken);
    } catch (error) {
      // Ended already (expired, killed): its events, the result last, are in the log.
      console.error(error.message);
      followLog = true;
    }
    if (followLog) catchUp();
  }

  const subscribeTimer = setTimeout(() => {
    console.error("live updates are slow to connect: starting, and following the event log");
    start(true);
  }, SUBSCRIBE_WAIT_MS);
  const channel = pusher.subscribe(job.channel);
  channel.bind("pusher:subscription_error", (error) => {
    // The log has every event: a run is never given up for its live view alone.
    console.error("subscription failed", JSON.stringify(error), "; following the event log");
    if (started) catchUp();
    else start(true);
  });
  channel.bind("pusher:subscription_succeeded", () => {
    if (started) {
      // pusher-js subscribed again after a reconnect: the job was started already, and
      // what was published while the connection was down is only in the log.
      catchUp();
      return;
    }
    start(false);
  });
  channel.bind_global((event, data) => {
    if (!event.startsWith("pusher:")) take(event, data);
  });
}
