// Run N short jobs one after another the way a browser IDE does (subscribe with pusher-js,
// start on subscription_succeeded) and report, per job, the seqs received live in arrival
// order. Used by the test suite to prove a live client sees seq 0, 1, 2 … with no hole.
//
//   node seq-check.mjs <apiUrl> <apiToken> <runs>
import { apiCaller, connectRealtime } from "./stack-client.mjs";

const [apiUrl, apiToken, runsArg] = process.argv.slice(2);
const runs = Number(runsArg || 50);
const call = apiCaller(apiUrl);
const { pusher, tokens } = await connectRealtime(apiUrl);

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
