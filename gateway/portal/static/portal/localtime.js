// Every <time datetime> the server wrote in UTC, shown in the reader's own time zone.
(function () {
  const options = {
    datetime: { year: "numeric", month: "short", day: "numeric", hour: "2-digit", minute: "2-digit", timeZoneName: "short" },
    date: { year: "numeric", month: "short", day: "numeric" },
  };
  document.querySelectorAll("time[datetime]").forEach((el) => {
    const when = new Date(el.getAttribute("datetime"));
    if (isNaN(when)) return;
    el.title = el.textContent;  // the UTC original, on hover
    el.textContent = when.toLocaleString(undefined, options[el.dataset.style] || options.datetime);
  });
})();
