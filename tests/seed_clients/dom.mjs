// A browser-like global environment (jsdom) for React. Imported before react-dom so that
// react-dom sees `window` and `document` when it loads, exactly as in a browser.
import { JSDOM } from "jsdom";

const dom = new JSDOM("<!doctype html><html><body></body></html>", { url: "http://127.0.0.1/" });

globalThis.window = dom.window;
globalThis.document = dom.window.document;
for (const name of ["HTMLElement", "Node", "Element", "Event", "MutationObserver"]) {
  if (globalThis[name] === undefined) globalThis[name] = dom.window[name];
}
if (globalThis.navigator === undefined) {
  Object.defineProperty(globalThis, "navigator", { value: dom.window.navigator, configurable: true });
}

export { dom };
