// On a phone the sections are one swipeable row: start it at the page you are on.
(function () {
  const current = document.querySelector("header.top nav a.current");
  const nav = current && current.parentElement;
  if (nav && nav.scrollWidth > nav.clientWidth) {
    nav.scrollLeft = current.offsetLeft - (nav.clientWidth - current.offsetWidth) / 2;
  }
})();
