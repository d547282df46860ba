// Shared helpers of the seed-client tests: the stack's address (from the environment), the
// seed SDK client, a React root that mounts the seed hook in jsdom, a raw pusher-js
// listener, and the durable event log (SSE).
import "./dom.mjs"; // must come before react-dom
import { createElement, useEffect } from "react";
import { createRoot } from "react-dom/client";
import Pusher from "pusher-js";
import { CodeRunnerProvider, useCodeRunnerJob } from "@teovilla/code-runner-react";
import { CodeRunnerClient } from "@teovilla/code-runner-sdk-node";

export const API_URL = (process.env.CODERUNNER_API_URL ?? "").replace(/\/+$/, "");
export const API_TOKEN = process.env.CODERUNNER_API_TOKEN ?? "";
if (!API_URL || !API_TOKEN) {
  throw new Error("CODERUNNER_API_URL and CODERUNNER_API_TOKEN must name a running coderunner stack");
}
if (!/^http:\/\/(127\.\d+\.\d+\.\d+|localhost|\[::1\])(:\d+)?$/.test(API_URL)) {
  throw new Error(`these tests only talk to loopback addresses, not ${API_URL}`);
}

export const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

/** `promise`, or a rejection naming `what` after `ms` (the timer never outlives the race). */
export async function withTimeout(promise, ms, what) {
  let timer;
  const timeout = new Promise((_, reject) => {
    timer = setTimeout(() => reject(new Error(`timed out after ${ms} ms: ${what}`)), ms);
  });
  try {
    return await Promise.race([promise, timeout]);
  } finally {
    clearTimeout(timer);
  }
}

/** The seed SDK client, exactly as its README builds it. */
export function sdk(token = API_TOKEN) {
  return new CodeRunnerClient({ baseUrl: API_URL, token });
}

export const py = (content, extra = {}) => ({
  language: "python",
  files: [{ name: "main.py", content }],
  ...extra,
});

export const ENDED = ["done", "killed", "error", "expired", "lost"];

const tracked = new Set();
/** `client.execute(body)`, remembering the job so that `endJobs` can clean up after a failure. */
export async function execute(client, body) {
  const job = await client.execute(body);
  tracked.add(job.jobId);
  return job;
}

/** Kill every job a test created that has not ended (a failed test must not hold slots). */
export async function endJobs() {
  const admin = sdk();
  for (const jobId of [...tracked]) {
    tracked.delete(jobId);
    try {
      const status = await admin.getJob(jobId);
      if (!ENDED.includes(status.state)) await admin.kill(jobId);
    } catch {
      // best effort
    }
  }
}

let realtimeInfo;
/** GET /v1/realtime: {key, wsHost, wsPort, forceTLS}. */
export async function realtime() {
  if (!realtimeInfo) {
    const response = await fetch(`${API_URL}/v1/realtime`);
    if (response.status !== 200) throw new Error(`/v1/realtime answered ${response.status}`);
    realtimeInfo = await response.json();
    if (!/^(127\.\d+\.\d+\.\d+|localhost|::1)$/.test(realtimeInfo.wsHost)) {
      throw new Error(`soketi is not on a loopback address: ${realtimeInfo.wsHost}`);
    }
  }
  return realtimeInfo;
}

/** Poll `check` until it returns a truthy value; fail after `timeoutMs` saying `what()`. */
export async function waitFor(check, timeoutMs, what) {
  const deadline = Date.now() + timeoutMs;
  for (;;) {
    const value = await check();
    if (value) return value;
    if (Date.now() > deadline) throw new Error(`timed out after ${timeoutMs} ms: ${what()}`);
    await sleep(20);
  }
}

/** Poll GET /v1/jobs/:id (the SDK's getJob) until its state is one of `states`. */
export async function waitState(client, jobId, states, timeoutMs = 20000) {
  let last;
  await waitFor(
    async () => {
      last = await client.getJob(jobId);
      return states.includes(last.state);
    },
    timeoutMs,
    () => `job ${jobId} stayed ${JSON.stringify(last)}; wanted ${states}`,
  );
  return last;
}

const mounted = new Set();

/**
 * Mount `<CodeRunnerProvider …><Probe/></CodeRunnerProvider>` in a jsdom container, the
 * Probe calling `useCodeRunnerJob(hookArgs)`. One provider per job, authorised with that
 * job's jobToken. Returns the latest hook state, a waiter, and unmount.
 */
/** `auth`, when given, replaces the provider's authorisation (its `authEndpoint` and
 * `authHeaders`): a backend of the app's own that signs subscriptions, say. */
export async function mountJob(job, hookArgs, auth = null) {
  const info = await realtime();
  const container = document.createElement("div");
  document.body.appendChild(container);
  const root = createRoot(container);
  const view = { state: null, renders: 0 };

  function Probe() {
    const state = useCodeRunnerJob(hookArgs);
    useEffect(() => {
      view.state = state;
      view.renders += 1;
    });
    return createElement(
      "div",
      null,
      createElement("pre", { className: "stdout" }, state.stdout),
      createElement("pre", { className: "stderr" }, state.stderr),
      createElement("pre", { className: "compile" }, state.compileOutput),
      createElement("span", { className: "status" }, state.status),
    );
  }

  root.render(
    createElement(
      CodeRunnerProvider,
      {
        appKey: info.key,
        host: info.wsHost,
        port: info.wsPort,
        useTLS: info.forceTLS,
        ...(auth ?? {
          authEndpoint: `${API_URL}/v1/channel-auth`,
          authHeaders: { Authorization: `Bearer ${job.jobToken}` },
        }),
      },
      createElement(Probe),
    ),
  );

  const handle = {
    container,
    get state() {
      return view.state;
    },
    text(cls) {
      return container.querySelector(`.${cls}`)?.textContent ?? null;
    },
    waitFor(predicate, timeoutMs, what) {
      return waitFor(
        () => view.state !== null && predicate(view.state),
        timeoutMs,
        () => `${what}; hook state: ${describe(view.state)}`,
      );
    },
    unmount() {
      if (!mounted.delete(handle)) return;
      root.unmount();
      container.remove();
    },
  };
  mounted.add(handle);
  return handle;
}

function describe(state) {
  if (!state) return "never rendered";
  const { stage, stdout, stderr, compileOutput, result, status } = state;
  return JSON.stringify({ status, stage, stdout, stderr, compileOutput, result });
}

/** Unmount whatever a failed test left mounted (each provider then disconnects pusher-js). */
export function unmountAll() {
  for (const handle of [...mounted]) handle.unmount();
}

/**
 * A plain pusher-js client on one job channel (authorised with `token`), recording every
 * non-internal event with its payload. `subscribed` resolves on subscription_succeeded.
 */
export async function rawListener(job, token) {
  const info = await realtime();
  const pusher = new Pusher(info.key, {
    cluster: "",
    wsHost: info.wsHost,
    wsPort: info.wsPort,
    forceTLS: info.forceTLS,
    enabledTransports: ["ws"],
    channelAuthorization: {
      endpoint: `${API_URL}/v1/channel-auth`,
      transport: "ajax",
      headers: { Authorization: `Bearer ${token}` },
    },
  });
  const events = [];
  const channel = pusher.subscribe(job.channel);
  const subscribed = new Promise((resolve, reject) => {
    channel.bind("pusher:subscription_succeeded", resolve);
    channel.bind("pusher:subscription_error", (error) => reject(new Error(`subscription failed: ${JSON.stringify(error)}`)));
  });
  channel.bind_global((event, data) => {
    if (!event.startsWith("pusher")) events.push({ event, data });
  });
  return { events, subscribed, close: () => pusher.disconnect() };
}

/** Every event of a job from the durable log, GET /v1/jobs/:id/events (SSE), until the result. */
export async function eventLog(jobId, timeoutMs = 20000) {
  const response = await fetch(`${API_URL}/v1/jobs/${jobId}/events`, {
    headers: { Authorization: `Bearer ${API_TOKEN}` },
    signal: AbortSignal.timeout(timeoutMs),
  });
  if (response.status !== 200) throw new Error(`event log answered ${response.status}: ${await response.text()}`);
  const text = await response.text();
  const events = [];
  for (const block of text.split("\n\n")) {
    let event = null;
    let data = null;
    for (const line of block.split("\n")) {
      if (line.startsWith("event: ")) event = line.slice(7);
      else if (line.startsWith("data: ")) data = JSON.parse(line.slice(6));
    }
    if (event !== null) events.push({ event, data });
  }
  return events;
}
