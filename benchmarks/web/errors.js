// Records every script error of the dashboard page in <ul id="errors"> and
// <body data-errors="N">, where a headless browser run (--dump-dom) reads
// them. Inlined first in <head>, before Chart.js and dashboard.js.
(function () {
  'use strict';
  var pending = [];
  function record(message) {
    var list = document.getElementById('errors');
    if (!list || !document.body) {
      pending.push(message);
      return;
    }
    var item = document.createElement('li');
    item.textContent = message;
    list.appendChild(item);
    document.body.setAttribute('data-errors', String(list.children.length));
  }
  window.dashboardRecordError = record;
  window.addEventListener('error', function (e) {
    record('error: ' + (e.message || String(e.error)) + ' (line ' +
           (e.lineno || 0) + ':' + (e.colno || 0) + ')');
  });
  window.addEventListener('unhandledrejection', function (e) {
    record('unhandled rejection: ' + String(e.reason));
  });
  // Chart.js reports some failures (no 2d context, bad config) with
  // console.error and carries on: count those as errors too.
  var consoleError = console.error;
  console.error = function () {
    record('console.error: ' + Array.prototype.map.call(arguments, String)
        .join(' '));
    return consoleError.apply(console, arguments);
  };
  document.addEventListener('DOMContentLoaded', function () {
    pending.splice(0).forEach(record);
  });
})();
