// Run one program through coderunner and follow it with pusher-js, the way a browser IDE
// does: submit, subscribe to the private channel (authorised with the job token), call
// start only after the subscription succeeded, print every event as a JSON line, and
// exit after the single `result` event.
//
//   node run-job.mjs <apiUrl> <apiToken> <language> <file> [stdin]
import { readFileSync } from "node:fs";
import { basename } from "node:path";
import Pusher from "pusher-js";

const [apiUrl, apiToken, language, file, stdin] = process.argv.slice(2);
if (!file) {
  console.error("usage: node run-job.mjs <apiUrl> <apiToken> <language> <file> [stdin]");
  process.exit(2);
}

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
const job = await call("POST", "/v1/execute", apiToken, {
  language,
  files: [{ name: basename(file), content: readFileSync(file, "utf8") }],
  ...(stdin === undefined ? {} : { stdin }),
});

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

const timer = setTimeout(() => {
  console.error("timed out waiting for the result");
  process.exit(1);
}, 30000);

const channel = pusher.subscribe(job.channel);
channel.bind("pusher:subscription_error", (error) => {
  console.error("subscription failed", JSON.stringify(error));
  process.exit(1);
});
channel.bind("pusher:subscription_succeeded", async () => {
  await call("POST", `/v1/jobs/${job.jobId}/start`, job.jobToken);
});
channel.bind_global((event, data) => {
  if (event.startsWith("pusher:")) return;
  console.log(JSON.stringify({ event, data }));
  if (event === "result") {
    clearTimeout(timer);
    pusher.disconnect();
    process.exit(0);
  }
});
