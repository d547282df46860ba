// What the repository's own Node clients share (the test client seq-check.mjs and
// bench/interactive.mjs): API calls with a bearer token, and one pusher-js connection that
// authorises each job's private channel with that job's own token. run-job.mjs stays
// self-contained on purpose: it is the example to copy.
import Pusher from "pusher-js";

/** `call(method, path, token, body?)`: the JSON answer, or an Error naming the status. */
export function apiCaller(apiUrl) {
  return async function call(method, path, token, body) {
    const response = await fetch(apiUrl + path, {
      method,
      headers: { authorization: `Bearer ${token}`, "content-type": "application/json" },
      body: body === undefined ? undefined : JSON.stringify(body),
    });
    const data = await response.json();
    if (!response.ok) throw new Error(`${method} ${path}: ${response.status} ${JSON.stringify(data)}`);
    return data;
  };
}

/** One pusher-js client; put `channel -> jobToken` into the returned `tokens` map before
 * subscribing, and channel-auth is asked with that job's token (never the API token). */
export async function connectRealtime(apiUrl) {
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
  return { pusher, tokens };
}
