// Run N short jobs one after another the way a browser IDE does (subscribe with pusher-js,
// start on subscription_succeeded) and report, per job, the seqs received live in arrival
// order. Used by the test suite to prove a live client sees seq 0, 1, 2 … with no hole.
//
//   node seq-check.mjs <apiUrl> <apiToken> <runs>
import Pusher from "pusher-js";

const [apiUrl, apiToken, runsArg] = process.argv.slice(2);
const runs = Number(runsArg || 50);

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

const realtime = await (await fetch(apiUrl + "/v1/realtime")).json();
const tokens = new Map();
const pusher = new Pusher(realtime.key, {
  cluster: realtime.cluster,
  wsHost: realtime.wsHost,
  wsPort: realtime.wsPort,
  forceTLS: realtime.forceTLS,
  enabledTransports: ["ws"],
  channelAuthorization: {
    customHandler: async ({ socketId, channelName }, callback) => {
      try {
        const body = new URLSearchParams({ socket_id: socketId, channel_name: channelName });
        const r = await fetch(apiUrl + "/v1/channel-auth", {
          method: "POST",
          body,
          headers: { authorization: `Bearer ${tokens.get(channelName)}` },
        });
        callback(r.ok ? null : new Error(`channel-auth ${r.status}`), r.ok ? await r.json() : null);
      } catch (error) {
        callback(error, null);
      }
    },
  },
});

function runOne(i) {
  return new Promise(async (resolve, reject) => {
    const job = await call("POST", "/v1/execute", apiToken, {
      language: "python",
      files: [{ name: "main.py", content: `print(${i})` }],
    });
    tokens.set(job.channel, job.jobToken);
    const seqs = [];
    const names = [];
    const timer = setTimeout(() => reject(new Error(`job ${job.jobId}: no result in 30 s; got ${JSON.stringify(names)}`)), 30000);
    const channel = pusher.subscribe(job.channel);
    channel.bind("pusher:subscription_succeeded", () => call("POST", `/v1/jobs/${job.jobId}/start`, job.jobToken).catch(reject));
    channel.bind("pusher:subscription_error", (e) => reject(new Error("subscription failed " + JSON.stringify(e))));
    channel.bind_global((event, data) => {
      if (event.startsWith("pusher:")) return;
      seqs.push(data.seq);
      names.push(event);
      if (event === "result") {
        clearTimeout(timer);
        // A moment more: a duplicate or late event would show up here.
        setTimeout(() => {
          pusher.unsubscribe(job.channel);
          resolve({ jobId: job.jobId, seqs, names });
        }, 100);
      }
    });
  });
}

const report = [];
for (let i = 0; i < runs; i++) report.push(await runOne(i));
console.log(JSON.stringify(report));
pusher.disconnect();
process.exit(0);
